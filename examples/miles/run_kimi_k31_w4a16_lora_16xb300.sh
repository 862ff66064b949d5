#!/usr/bin/env bash
# Kimi K3.1 W4A16 LoRA RL with miles on 16 B300 (2 nodes x 8), seed 001. The same recipe as
# run_kimi_k31_w4a16_lora_32xh200.sh (which this script runs) with the seed's B300 settings:
#   - the H200 per-stage layout on half the GPUs: TP4 PP2 CP2 EP8 (47/46 layers per stage);
#   - one SGLang engine over the 16 GPUs: TP16, EP16, attention DP 2, 524288 KV tokens per DP group;
#   - 16 prompts x 16 samples, global batch 256, with the dynamic-sampling filter (groups of equal
#     rewards dropped, refilled 4 groups at a time);
#   - no host copy of the base in SGLang: each card holds twice the H200 share of the model, so the
#     host has no room next to the trainer's offloaded weights, and the base is re-sent at every sync.
# Every knob of the H200 script can still be overridden from the environment.
# What our plugins replace is listed in run_kimi_k31_w4a16_lora_32xh200.sh; docs/recipes/kimi_k31_w4a16_lora.md.
#
#   SAVE_DIR=/shared/ckpt bash examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh
#   DRY_RUN=1 bash examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh

set -euo pipefail
b300_default() { if [[ -z "${!1:-}" ]]; then export "$1=$2"; fi; }
b300_default NUM_NODES 2
b300_default GPUS_PER_NODE 8
b300_default PP 2
b300_default ROLLOUT_ATTN_DP 2
b300_default SGLANG_MAX_TOTAL_TOKENS 524288
b300_default ROLLOUT_BATCH_SIZE 16
b300_default GLOBAL_BATCH_SIZE 256
b300_default DYNAMIC_SAMPLING 1
b300_default OVER_SAMPLING_BATCH_SIZE 4
b300_default LORA_BASE_CPU_BACKUP 0
b300_default MODEL_DIR /scratch/models
b300_default DATA_DIR /scratch/datasets
export KIMI_SCRIPT_NAME=examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_kimi_k31_w4a16_lora_32xh200.sh" "$@"
