#!/usr/bin/env bash
# Tiny CPU version of examples/miles/run_kimi_k3_lora.sh (seed 000, Kimi K3 LoRA RL with miles).
# What runs here, on one CPU machine (0. the sample prompts of examples/data converted by
# `kimi-rl prepare-data`) in well under a minute with the defaults:
#   1. a tiny K3 checkpoint in the release format (MXFP4 routed experts, real tensor names);
#   2. the BF16 copy the seed had to make (tools/convert_mxfp4_to_bf16.py) -- here only to prove
#      that it adds nothing: our trainer reads the MXFP4 bytes directly;
#   3. `kimi-rl check-numerics`: the reference model on the MXFP4 checkpoint against the same model
#      on the BF16 copy (identical logprobs, so W4A16 on MXFP4 trains on exactly the served weights),
#      plus any engine named in ENGINES that is installed (megatron, sglang need their hosts);
# and what needs GPUs is printed: the launch script's exact command for one 8-GPU node on this
# tiny checkpoint (DRY_RUN=1).
#   bash examples/local/run_kimi_k3_lora_tiny.sh
#   ENGINES=reference,megatron LAYERS=5 bash examples/local/run_kimi_k3_lora_tiny.sh

KIMI_SCRIPT_NAME=examples/local/run_kimi_k3_lora_tiny.sh
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
kimi_local_knobs kimi_k3_lora
kimi_knob ENGINES "reference,reference@$OUT/tiny-k3-bf16"

kimi_local_step "dapo-math and AIME sample prompts in miles' format (kimi-rl prepare-data; no download)" \
  kimi_local_prepare_data "$OUT/data"
kimi_local_step "tiny Kimi K3 checkpoint, MXFP4 routed experts as published" \
  kimi_local_make_tiny k3 "$OUT/tiny-k3"
kimi_local_step "the seed's BF16 copy (not needed with our plugins; made here only to compare against)" \
  $KIMI_RL dequantize --input "$OUT/tiny-k3" --output "$OUT/tiny-k3-bf16"
kimi_local_step "logprobs on MXFP4 vs on the BF16 copy (and any installed engine)" \
  $KIMI_RL check-numerics --model "$OUT/tiny-k3" --engines "$ENGINES" --tokens "$TOKENS" --batch 1 \
    --dtype "$NUMERICS_DTYPE" --out "$OUT/numerics"

kimi_local_k3_sizes "$OUT/tiny-k3"
kimi_local_show_cluster_command examples/miles/run_kimi_k3_lora.sh \
  NUM_NODES=1 GPUS_PER_NODE=8 TP=1 PP=1 CP=1 EP=8 ROLLOUT_TP=2 ROLLOUT_EP=1 \
  NUM_ROLLOUT=2 ROLLOUT_BATCH_SIZE=4 N_SAMPLES_PER_PROMPT=2 GLOBAL_BATCH_SIZE=8 \
  ROLLOUT_MAX_RESPONSE_LEN=256 SGLANG_MAX_TOTAL_TOKENS=8192 MAX_TOKENS_PER_GPU=1024 EVAL_INTERVAL=1 \
  DATA_DIR="$OUT/data" HF_CHECKPOINT="$OUT/tiny-k3" SAVE_DIR="$OUT/ckpt" RUN_ID=tiny
echo
echo "done: tiny K3 checkpoint, numerics report in $OUT/numerics; the cluster command above was printed, not run."
