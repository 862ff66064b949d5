#!/usr/bin/env bash
# Kimi K3.1 W4A16 LoRA RL with miles on 32 H200 (4 nodes x 8), seed 001 ("Kimi-K3.1" miles recipe).
# Rank-32 LoRA (alpha 64, all-linear, shared-outer experts) on K3.1's text decoder with score
# centering on the sampler's top-128 candidates, dapo-math-17k with a deepscaler reward, R3 routing
# replay, one colocated SGLang engine over all 32 GPUs. The trainer keeps the routed experts as the
# checkpoint's MXFP4 bytes (about 47 GB per GPU instead of about 180 GB in BF16).
# examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh runs the same recipe on 16 B300 through this
# script; docs/recipes/kimi_k31_w4a16_lora.md has the numbers.
#
# What our plugins replace, compared with the seed:
#   - No Kimi branches: miles at its native-LoRA PR #1792 (docs/miles.md; no PRs #4666/#4667), stock
#     Megatron-LM miles-main and stock SGLang 0.5.17 instead of the sglang-miles-kimi-k31 branch in the
#     radixark/miles:kimi-k31 image. kimi_sglang_plugin (SGLANG_PLUGINS=kimi) supplies K3.1 (K3 + DSA indexer, with SGLang's
#     DSA pools selected), MoE LoRA on the Marlin MXFP4 runner with SiTU, and the K3 LoRA fixes of
#     sglang#37704 as version-checked hooks; our Megatron spec supplies K3.1 and the W4A16 experts.
#   - Still no BF16 copy and no torch_dist conversion (the seed already read the release as
#     published): --hf-checkpoint and --ref-load both name the native checkpoint.
#   - Adapter-only sync (H200): --lora-base-cpu-backup; each engine rank keeps only its experts'
#     rows. The sync is checked by our bucket checksums; the seed's --check-lora-weight-equal
#     (SHA-256 of every tensor, about 167 s of a 187 s sync) stays off.
#   - Score centering and the reward come from kimi_rl_glue (--loss-type custom_loss,
#     --custom-rm-path) instead of the branch's built-in --loss-type score_centering; the sampler's
#     top-K per token from our generate function (--custom-generate-function-path, which also defines
#     --rollout-top-logprobs-num) and carried into the train batch by our conversion
#     (--custom-convert-samples-to-train-data-path) instead of the branch's rollout.
#
# Usage: start one Ray cluster over the nodes, then from node 0
#   SAVE_DIR=/shared/ckpt bash examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh
#   DRY_RUN=1 bash examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh     # print env and command
# Resume from a save (same layout): EXTRA_ARGS="--lora-adapter-path <dir> --no-load-optim"

KIMI_SCRIPT_NAME=${KIMI_SCRIPT_NAME:-examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh}
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
kimi_miles_require --lora-provider-path   # first: a miles without it fails here, naming the commit
# shellcheck source=examples/miles/models/kimi_k31.sh
source "$KIMI_EXAMPLES_DIR/miles/models/kimi_k31.sh"

# --- scale knobs (defaults: the seed's 32 x H200 run) ----------------------------------------------
kimi_knob NUM_NODES 4
kimi_knob GPUS_PER_NODE 8
kimi_knob TP 4
kimi_knob PP 4
kimi_knob CP 2
kimi_knob EP 8                          # the 8 ranks of a pipeline stage (TP4 x CP2) form its EP group
kimi_knob ROLLOUT_TP $(( NUM_NODES * GPUS_PER_NODE ))   # one engine over every GPU
kimi_knob ROLLOUT_EP "$ROLLOUT_TP"                      # whole experts per rank
kimi_knob ROLLOUT_ATTN_DP "$NUM_NODES"                  # one attention-DP group of TP 8 per node
kimi_knob ROLLOUT_MAX_RUNNING_REQUESTS 256
kimi_knob SGLANG_MAX_TOTAL_TOKENS 262144                # per DP group: 64 requests x (3072 + 1024)
kimi_knob LORA_RANK 32
kimi_knob LORA_ALPHA 64
kimi_knob LORA_BASE_CPU_BACKUP 1        # 1: adapter-only sync; 0: the base is re-sent at every sync
kimi_knob NUM_ROLLOUT 100
kimi_knob ROLLOUT_BATCH_SIZE 32         # prompts per step
kimi_knob N_SAMPLES_PER_PROMPT 16
kimi_knob GLOBAL_BATCH_SIZE 512         # one optimizer step per rollout
kimi_knob DYNAMIC_SAMPLING 0            # 1: drop groups with equal rewards, refill OVER_SAMPLING_BATCH_SIZE at a time
kimi_knob OVER_SAMPLING_BATCH_SIZE 4
kimi_knob ROLLOUT_MAX_RESPONSE_LEN 3072
kimi_knob TOP_LOGPROBS_NUM 128          # score centering's candidate set H
kimi_knob MAX_TOKENS_PER_GPU 8192
kimi_knob LR 1e-5
kimi_knob SAVE_INTERVAL 5
kimi_knob EVAL_INTERVAL 0               # >0: AIME-2024 eval every N rollouts
kimi_knob DISTRIBUTED_TIMEOUT_MINUTES 60
# --- paths ------------------------------------------------------------------------------------------
kimi_knob MODEL_DIR /root/models
kimi_knob HF_CHECKPOINT "$MODEL_DIR/Kimi-K3.1"      # same path on every node
kimi_knob DATA_DIR /root/datasets                   # written by `kimi-rl prepare-data`
kimi_knob PROMPT_DATA "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl"
kimi_knob EVAL_DATA "$DATA_DIR/aime-2024/aime-2024.jsonl"
kimi_knob SAVE_DIR /root/checkpoints                # shared by all nodes: every rank writes its shard
kimi_knob ENABLE_WANDB 0
kimi_miles_knobs

TOTAL_GPUS=$(( NUM_NODES * GPUS_PER_NODE ))
kimi_divides $(( TP * PP * CP )) "$TOTAL_GPUS" "TP*PP*CP (TP=$TP PP=$PP CP=$CP) vs NUM_NODES*GPUS_PER_NODE"
DP=$(( TOTAL_GPUS / (TP * PP * CP) ))
kimi_divides "$EP" $(( TP * CP * DP )) "EP=$EP vs the TP*CP*DP ranks of a pipeline stage"
kimi_divides "$ROLLOUT_TP" "$TOTAL_GPUS" "ROLLOUT_TP vs NUM_NODES*GPUS_PER_NODE"
kimi_divides "$ROLLOUT_EP" "$ROLLOUT_TP" "ROLLOUT_EP vs ROLLOUT_TP"
kimi_divides "$ROLLOUT_ATTN_DP" "$ROLLOUT_TP" "ROLLOUT_ATTN_DP vs ROLLOUT_TP"
kimi_divides "$N_SAMPLES_PER_PROMPT" "$GLOBAL_BATCH_SIZE" "N_SAMPLES_PER_PROMPT vs GLOBAL_BATCH_SIZE"
kimi_pp_split "$K3_NUM_LAYERS" "$PP"
kimi_miles_plugin_args kimi_k31
kimi_miles_env
kimi_env NCCL_RAS_ENABLE 0              # NCCL 2.30.7's RAS thread segfaulted after the engine's first release
if (( ROLLOUT_ATTN_DP > 1 )); then
  # every attention-TP rank of a DP group attends rank 0's DSA top-k (else ranks may pick different keys)
  kimi_env SGLANG_DSA_TOPK_BROADCAST 1
fi

# attention DP in SGLang 0.5.17's spelling (the one this miles imports; --attn-dp-size is 0.5.23's)
ATTN_DP_ARGS=()
(( ROLLOUT_ATTN_DP > 1 )) && ATTN_DP_ARGS=(--sglang-dp-size "$ROLLOUT_ATTN_DP" --sglang-enable-dp-attention)
OPTIONAL=()
[[ "$LORA_BASE_CPU_BACKUP" == 1 ]] && OPTIONAL+=(--lora-base-cpu-backup)
if [[ "$DYNAMIC_SAMPLING" == 1 ]]; then
  OPTIONAL+=(--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
             --over-sampling-batch-size "$OVER_SAMPLING_BATCH_SIZE")
fi
if (( EVAL_INTERVAL > 0 )); then
  OPTIONAL+=(--eval-interval "$EVAL_INTERVAL" --eval-prompt-data aime "$EVAL_DATA" --eval-input-key prompt
             --n-samples-per-eval-prompt 1 --eval-temperature 0 --eval-max-response-len "$ROLLOUT_MAX_RESPONSE_LEN")
fi
[[ "$ENABLE_WANDB" == 1 ]] && OPTIONAL+=(--use-wandb --wandb-project kimi-k31-w4a16-lora --wandb-group "$RUN_ID")

ARGS=(
  "${KIMI_MILES_PLUGIN_ARGS[@]}"
  --hf-checkpoint "$HF_CHECKPOINT"
  --ref-load "$HF_CHECKPOINT"
  # LoRA: rank 32 / alpha 64 on all-linear (K3's HF defaults), experts share their outer factors
  --lora-rank "$LORA_RANK" --lora-alpha "$LORA_ALPHA" --lora-dropout 0
  --target-modules all-linear
  --experts-shared-outer-loras
  --no-gradient-accumulation-fusion
  # data and reward
  --prompt-data "$PROMPT_DATA" --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle
  --custom-rm-path "$KIMI_MILES_REWARD"
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size "$ROLLOUT_BATCH_SIZE"
  --n-samples-per-prompt "$N_SAMPLES_PER_PROMPT" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --rollout-max-response-len "$ROLLOUT_MAX_RESPONSE_LEN"
  --rollout-temperature 1 --rollout-top-p 1
  # score centering: REINFORCE-style, A = R - group mean, per-token loss, rollout log-probs as old policy
  --loss-type custom_loss --custom-loss-function-path "$KIMI_MILES_LOSS_SCORE_CENTERING"
  --custom-generate-function-path "$KIMI_MILES_TOPK_GENERATE" --rollout-top-logprobs-num "$TOP_LOGPROBS_NUM"
  --custom-convert-samples-to-train-data-path "$KIMI_MILES_TOPK_TRAIN_DATA"
  --advantage-estimator grpo --disable-grpo-std-normalization
  --use-rollout-logprobs --calculate-per-token-loss
  --kl-loss-coef 0 --entropy-coef 0
  --use-rollout-routing-replay
  # trainer parallelism and memory
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --pipeline-model-parallel-size "$PP" "${KIMI_PP_SPLIT_ARGS[@]}"
  --context-parallel-size "$CP"
  --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU" --log-probs-chunk-size 512
  --distributed-timeout-minutes "$DISTRIBUTED_TIMEOUT_MINUTES"
  # Adam, constant lr, 80% of its state on the CPU
  --optimizer adam --lr "$LR" --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --optimizer-cpu-offload --optimizer-offload-fraction 0.8 --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer --use-distributed-optimizer
  # one SGLang engine over all GPUs, colocated, attention DP with one group per node
  --colocate --offload-train
  --rollout-num-gpus-per-engine "$ROLLOUT_TP"
  --sglang-tp-size "$ROLLOUT_TP" --sglang-ep-size "$ROLLOUT_EP" "${ATTN_DP_ARGS[@]}"
  --sglang-moe-runner-backend marlin
  --sglang-lora-backend triton
  --sglang-kv-cache-dtype bfloat16
  --sglang-max-total-tokens "$SGLANG_MAX_TOTAL_TOKENS"
  --sglang-max-running-requests "$ROLLOUT_MAX_RUNNING_REQUESTS"
  --sglang-load-balance-method total_requests
  --sglang-max-lora-rank "$LORA_RANK"
  --actor-num-nodes "$NUM_NODES" --actor-num-gpus-per-node "$GPUS_PER_NODE" --num-gpus-per-node "$GPUS_PER_NODE"
  --save "$SAVE_DIR/$RUN_ID" --save-interval "$SAVE_INTERVAL"
  "${OPTIONAL[@]}"
)

kimi_miles_launch "${ARGS[@]}"
