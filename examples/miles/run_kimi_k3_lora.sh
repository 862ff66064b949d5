#!/usr/bin/env bash
# Kimi K3 LoRA RL with miles (seed 000: "Kimi-K3 lora RL day-0 support", radixark/miles#1825).
# Rank-32 LoRA (alpha 64) on K3's text decoder, GRPO on dapo-math-17k with a deepscaler reward,
# AIME-2024 eval every 10 rollouts. Validated layout: 16 nodes x 4 GPUs, PP8 CP2 (so TP4, EP8),
# one colocated SGLang engine per 16 GPUs. docs/recipes/kimi_k3_lora.md has the full story.
#
# What our plugins replace, compared with the seed:
#   - No Kimi branches: miles at its native-LoRA PR #1792 (docs/miles.md; main lacks --lora-provider-path),
#     stock Megatron-LM miles-main and stock SGLang 0.5.17 (this miles imports a module 0.5.23 dropped).
#     The seed needed miles PR #1825 (kimi_k3 if/elif branches in model.py, lora_utils.py and the
#     raw converter), radixark/Megatron-LM#94 and the sglang-miles-k3 branch in a dedicated image.
#     Here: --spec kimi_megatron_plugin.spec get_spec (KDA, attention residuals, latent MoE),
#     --custom-megatron-init-path kimi_rl_glue.miles.init (megatron-core check, Megatron-Bridge registration),
#     --lora-provider-path kimi_rl_glue.miles.lora_provider (native Kimi LoRA, shared-outer experts),
#     SGLANG_PLUGINS=kimi (K3 MoE LoRA on MXFP4/SiTU experts, the sglang#37704 fixes as hooks).
#   - No BF16 copy and no torch_dist conversion: the seed ran tools/convert_mxfp4_to_bf16.py and a
#     32-rank convert_hf_to_torch_dist.py, then trained on a BF16 upcast while SGLang served MXFP4
#     (a built-in train/rollout mismatch). Here --hf-checkpoint and --ref-load both name the native
#     MXFP4 release; the trainer keeps the frozen experts as MXFP4 bytes (W4A16, dequantized inside
#     the grouped GEMM), bit-identical to what SGLang serves.
#   - Adapter-only sync: --lora-base-cpu-backup keeps the base in SGLang's host memory, so after the
#     first sync only the adapter travels, as checksummed HF-named buckets.
#   - The reward reads K3's response channel through --custom-rm-path (stock deepscaler does not).
#
# Usage: bring up a Ray cluster over the nodes (ray start --head / --address=...), then
#   bash examples/miles/run_kimi_k3_lora.sh                     # the seed's scale
#   DRY_RUN=1 bash examples/miles/run_kimi_k3_lora.sh          # print the env and command only
#   NUM_NODES=1 GPUS_PER_NODE=8 PP=1 CP=1 TP=8 EP=8 ROLLOUT_TP=8 NUM_ROLLOUT=2 bash ...   # smoke

KIMI_SCRIPT_NAME=examples/miles/run_kimi_k3_lora.sh
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
kimi_miles_require --lora-provider-path   # first: a miles without these fails here, naming the commit
# shellcheck source=examples/miles/models/kimi_k3.sh
source "$KIMI_EXAMPLES_DIR/miles/models/kimi_k3.sh"

# --- scale knobs (defaults: the seed's validated run) ----------------------------------------------
kimi_knob NUM_NODES 16
kimi_knob GPUS_PER_NODE 4
kimi_knob PP 8
kimi_knob CP 2
kimi_knob TP $(( NUM_NODES * GPUS_PER_NODE / (PP * CP) ))   # 4: the seed's derivation, DP = 1
kimi_knob EP 8                                              # TP x CP x DP ranks of one stage
kimi_knob ROLLOUT_TP 16
kimi_knob ROLLOUT_EP 1
kimi_knob ROLLOUT_MAX_CONCURRENCY 8     # the validated runs pin 8 (the launcher default was 64)
kimi_knob LORA_RANK 32
kimi_knob LORA_ALPHA 64
kimi_knob NUM_ROLLOUT 1000
kimi_knob ROLLOUT_BATCH_SIZE 8
kimi_knob N_SAMPLES_PER_PROMPT 8
kimi_knob GLOBAL_BATCH_SIZE 64
kimi_knob ROLLOUT_MAX_RESPONSE_LEN 4096
kimi_knob SGLANG_MAX_TOTAL_TOKENS 65536
kimi_knob MAX_TOKENS_PER_GPU 8192
kimi_knob LR 1e-5
kimi_knob EVAL_INTERVAL 10
kimi_knob SAVE_INTERVAL 50
kimi_knob DISTRIBUTED_TIMEOUT_MINUTES 60
kimi_knob UPDATE_WEIGHT_BUFFER_SIZE $(( 256 * 1024 * 1024 ))
kimi_knob SGLANG_DECODE_ATTENTION_BACKEND trtllm_mla   # the seed's GB300 runs; flashmla on Hopper
# --- paths ------------------------------------------------------------------------------------------
kimi_knob HF_CHECKPOINT /root/models/Kimi-K3        # the native MXFP4 release, read as published
kimi_knob DATA_DIR /root/datasets                   # written by `kimi-rl prepare-data`
kimi_knob PROMPT_DATA "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl"
kimi_knob EVAL_DATA "$DATA_DIR/aime-2024/aime-2024.jsonl"
kimi_knob SAVE_DIR /root/checkpoints
kimi_knob ENABLE_WANDB 0
kimi_miles_knobs

TOTAL_GPUS=$(( NUM_NODES * GPUS_PER_NODE ))
kimi_divides $(( TP * PP * CP )) "$TOTAL_GPUS" "TP*PP*CP (TP=$TP PP=$PP CP=$CP) vs NUM_NODES*GPUS_PER_NODE"
DP=$(( TOTAL_GPUS / (TP * PP * CP) ))
kimi_divides "$EP" $(( TP * CP * DP )) "EP=$EP vs the TP*CP*DP ranks of a pipeline stage"
kimi_divides "$ROLLOUT_TP" "$TOTAL_GPUS" "ROLLOUT_TP vs NUM_NODES*GPUS_PER_NODE"
kimi_divides "$ROLLOUT_EP" "$ROLLOUT_TP" "ROLLOUT_EP vs ROLLOUT_TP"
kimi_pp_split "$K3_NUM_LAYERS" "$PP"
kimi_miles_plugin_args kimi_k3
kimi_miles_env

# CUDA-graph decode batch sizes up to the request cap; K3's radix extra-buffer keeps 5 KDA slots a request.
GRAPH_BS=()
for b in 1 2 4 8 16 32; do (( b <= ROLLOUT_MAX_CONCURRENCY )) && GRAPH_BS+=("$b"); done
SGLANG_EXTRA=()
# Above TP8 the per-rank Marlin expert width is tile-padded; the fused_moe_lora path handles it.
(( ROLLOUT_TP > 8 )) && SGLANG_EXTRA+=(--no-sglang-lora-use-virtual-experts)
WANDB_ARGS=()
[[ "$ENABLE_WANDB" == 1 ]] && WANDB_ARGS=(--use-wandb --wandb-project kimi-k3-lora --wandb-group "$RUN_ID")

ARGS=(
  "${KIMI_MILES_PLUGIN_ARGS[@]}"
  --hf-checkpoint "$HF_CHECKPOINT"
  --ref-load "$HF_CHECKPOINT"
  # LoRA: rank 32 / alpha 64 on K3's HF default targets; experts share their outer factors
  --lora-rank "$LORA_RANK" --lora-alpha "$LORA_ALPHA" --lora-dropout 0
  --target-modules all-linear
  --experts-shared-outer-loras
  --lora-base-cpu-backup
  --no-gradient-accumulation-fusion
  # data, reward, eval
  --prompt-data "$PROMPT_DATA" --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle --balance-data
  --custom-rm-path "$KIMI_MILES_REWARD"
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size "$ROLLOUT_BATCH_SIZE"
  --n-samples-per-prompt "$N_SAMPLES_PER_PROMPT" --rollout-max-response-len "$ROLLOUT_MAX_RESPONSE_LEN"
  --rollout-temperature 1
  --global-batch-size "$GLOBAL_BATCH_SIZE" --use-dynamic-global-batch-size
  --eval-interval "$EVAL_INTERVAL" --eval-prompt-data aime "$EVAL_DATA" --eval-input-key prompt
  --n-samples-per-eval-prompt 1 --eval-temperature 0 --eval-max-response-len "$ROLLOUT_MAX_RESPONSE_LEN"
  # GRPO with clip-higher, no KL or entropy term
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
  --kl-loss-coef 0 --kl-loss-type low_var_kl --entropy-coef 0
  # trainer parallelism and memory
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --pipeline-model-parallel-size "$PP" "${KIMI_PP_SPLIT_ARGS[@]}"
  --context-parallel-size "$CP"
  --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU" --log-probs-chunk-size 512
  --distributed-timeout-minutes "$DISTRIBUTED_TIMEOUT_MINUTES"
  --accumulate-allreduce-grads-in-fp32
  # Adam, 80% of its state on the CPU
  --optimizer adam --lr "$LR" --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --optimizer-cpu-offload --optimizer-offload-fraction 0.8 --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer --use-distributed-optimizer
  # SGLang rollout, colocated with the trainer
  --colocate --offload-train
  --rollout-num-gpus-per-engine "$ROLLOUT_TP"
  --sglang-tp-size "$ROLLOUT_TP" --sglang-ep-size "$ROLLOUT_EP"
  --sglang-server-concurrency 16
  --sglang-max-running-requests "$ROLLOUT_MAX_CONCURRENCY"
  --sglang-max-mamba-cache-size $(( 5 * ROLLOUT_MAX_CONCURRENCY ))
  --sglang-cuda-graph-bs-decode "${GRAPH_BS[@]}"
  --sglang-max-total-tokens "$SGLANG_MAX_TOTAL_TOKENS"
  --sglang-lora-backend triton --sglang-lora-strict-loading --sglang-max-lora-rank "$LORA_RANK"
  --sglang-moe-runner-backend marlin
  --sglang-decode-attention-backend "$SGLANG_DECODE_ATTENTION_BACKEND"
  --sglang-mamba-radix-cache-strategy extra_buffer
  "${SGLANG_EXTRA[@]}"
  --use-miles-router --miles-router-health-check-failure-threshold 10
  --update-weight-buffer-size "$UPDATE_WEIGHT_BUFFER_SIZE"
  --train-memory-margin-bytes $(( 4 * 1024 * 1024 * 1024 ))
  --actor-num-nodes "$NUM_NODES" --actor-num-gpus-per-node "$GPUS_PER_NODE" --num-gpus-per-node "$GPUS_PER_NODE"
  --save "$SAVE_DIR/$RUN_ID" --save-interval "$SAVE_INTERVAL"
  "${WANDB_ARGS[@]}"
)

kimi_miles_launch "${ARGS[@]}"
