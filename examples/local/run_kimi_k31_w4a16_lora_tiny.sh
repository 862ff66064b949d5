#!/usr/bin/env bash
# Tiny CPU version of examples/miles/run_kimi_k31_w4a16_lora_{32xh200,16xb300}.sh (seed 001,
# Kimi K3.1 W4A16 LoRA RL with miles). What runs here, on one CPU machine:
#   0. the sample prompts of examples/data converted to miles' format by `kimi-rl prepare-data`;
#   1. a tiny K3.1 checkpoint (K3 plus the DSA indexer) with MXFP4 routed experts;
#   2. the bytes the trainer keeps for the frozen experts: MXFP4 as published against the BF16
#      that a dequantized copy would need (the seed's "about 47 GB instead of about 180 GB per GPU");
#   3. `kimi-rl check-numerics` on the MXFP4 checkpoint against its exact BF16 dequantization,
#      plus any engine named in ENGINES that is installed;
# and, printed for GPUs, both launchers' commands on one 8-GPU node with this tiny checkpoint.
#   bash examples/local/run_kimi_k31_w4a16_lora_tiny.sh

KIMI_SCRIPT_NAME=examples/local/run_kimi_k31_w4a16_lora_tiny.sh
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
kimi_local_knobs kimi_k31_w4a16_lora
kimi_knob ENGINES "reference,reference@$OUT/tiny-k31-bf16"

kimi_local_step "dapo-math and AIME sample prompts in miles' format (kimi-rl prepare-data; no download)" \
  kimi_local_prepare_data "$OUT/data"
kimi_local_step "tiny Kimi K3.1 checkpoint (DSA indexer on the MLA layers), MXFP4 routed experts" \
  kimi_local_make_tiny k31 "$OUT/tiny-k31"
kimi_local_step "exact BF16 dequantization, for comparison only" \
  $KIMI_RL dequantize --input "$OUT/tiny-k31" --output "$OUT/tiny-k31-bf16"
kimi_local_step "frozen routed-expert bytes: MXFP4 as the trainer keeps them vs a BF16 copy" \
  python3 - "$OUT/tiny-k31" "$OUT/tiny-k31-bf16" <<'PY'
import json, struct, sys
from pathlib import Path

def expert_bytes(ckpt):
    """Bytes of the routed-expert tensors, read from the safetensors headers (no tensor data loaded)."""
    total = 0
    for shard in Path(ckpt).glob("*.safetensors"):
        with open(shard, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__" and ".experts." in name and "shared" not in name:
                total += meta["data_offsets"][1] - meta["data_offsets"][0]
    return total

packed, bf16 = expert_bytes(sys.argv[1]), expert_bytes(sys.argv[2])
print(f"routed experts: MXFP4 {packed} bytes, BF16 {bf16} bytes ({bf16 / packed:.2f}x); "
      f"{packed / (bf16 / 2):.3f} bytes per parameter")
PY
kimi_local_step "logprobs on MXFP4 vs on the BF16 dequantization (and any installed engine)" \
  $KIMI_RL check-numerics --model "$OUT/tiny-k31" --engines "$ENGINES" --tokens "$TOKENS" --batch 1 \
    --dtype "$NUMERICS_DTYPE" --out "$OUT/numerics"

kimi_local_k3_sizes "$OUT/tiny-k31"
SHRINK=(NUM_NODES=1 GPUS_PER_NODE=8 TP=1 PP=1 CP=1 EP=8 ROLLOUT_TP=2 ROLLOUT_EP=2 ROLLOUT_ATTN_DP=1
        NUM_ROLLOUT=2 ROLLOUT_BATCH_SIZE=4 N_SAMPLES_PER_PROMPT=4 GLOBAL_BATCH_SIZE=16
        ROLLOUT_MAX_RESPONSE_LEN=256 SGLANG_MAX_TOTAL_TOKENS=8192 MAX_TOKENS_PER_GPU=1024 TOP_LOGPROBS_NUM=8
        DATA_DIR="$OUT/data" HF_CHECKPOINT="$OUT/tiny-k31" SAVE_DIR="$OUT/ckpt" RUN_ID=tiny)
kimi_local_show_cluster_command examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh "${SHRINK[@]}"
kimi_local_show_cluster_command examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh "${SHRINK[@]}"
echo
echo "done: tiny K3.1 checkpoint, numerics report in $OUT/numerics; the cluster commands above were printed, not run."
