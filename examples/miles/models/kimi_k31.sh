# shellcheck shell=bash
# Megatron model arguments for Kimi K3.1 (K3 plus a DSA lightning indexer on each of its 24 MLA
# layers), as the array MODEL_ARGS. Sourced by the examples/miles/run_kimi_k31_w4a16_lora_*.sh
# scripts. The indexer sizes (32 heads x 128, top-2048) are the seed's; the indexer stays frozen.

: "${K31_INDEX_HEADS:=32}" "${K31_INDEX_HEAD_DIM:=128}" "${K31_INDEX_TOPK:=2048}"
# shellcheck source=examples/miles/models/kimi_k3.sh
source "$(dirname "${BASH_SOURCE[0]}")/kimi_k3.sh"
MODEL_ARGS+=(
  --dsa-indexer-n-heads "$K31_INDEX_HEADS"
  --dsa-indexer-head-dim "$K31_INDEX_HEAD_DIM"
  --dsa-indexer-topk "$K31_INDEX_TOPK"
  --freeze-indexer
)
