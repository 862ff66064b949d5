# shellcheck shell=bash
# Megatron model arguments for Kimi K3 (moonshotai/Kimi-K3 text decoder), as the array MODEL_ARGS.
# Sourced by examples/miles/run_kimi_k3_lora.sh and, through kimi_k31.sh, the K3.1 scripts.
# The sizes default to the release config (kimi_core/release_configs.py; tests/examples checks
# them) and can be preset through the K3_* variables, which is how examples/local/ points the
# same launch scripts at a tiny checkpoint.
#
# The layer structure Megatron-Core lacks (KDA layers, the attention-residual bank, the latent MoE
# with SiTU, the W4A16 MXFP4 experts) comes from our spec, which reads the rest of the HF
# config.json at --hf-checkpoint; these flags size the model and pick stock Megatron features.

: "${K3_NUM_LAYERS:=93}" "${K3_HIDDEN:=7168}" "${K3_FFN_HIDDEN:=33792}" "${K3_HEADS:=96}" "${K3_VOCAB:=163840}"
: "${K3_Q_LORA_RANK:=1536}" "${K3_KV_LORA_RANK:=512}" "${K3_QK_HEAD_DIM:=128}" "${K3_QK_POS_HEAD_DIM:=64}"
: "${K3_V_HEAD_DIM:=128}" "${K3_EXPERTS:=896}" "${K3_TOPK:=16}" "${K3_MOE_FFN_HIDDEN:=3072}"
: "${K3_MOE_LATENT:=3584}" "${K3_SHARED_FFN_HIDDEN:=6144}" "${K3_FIRST_DENSE:=1}"

MODEL_ARGS=(
  --spec "${KIMI_MEGATRON_SPEC[@]}"
  --num-layers "$K3_NUM_LAYERS"
  --hidden-size "$K3_HIDDEN"
  --ffn-hidden-size "$K3_FFN_HIDDEN"
  --num-attention-heads "$K3_HEADS"
  --num-query-groups "$K3_HEADS"
  --vocab-size "$K3_VOCAB"
  --make-vocab-size-divisible-by 128
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --position-embedding-type none
  --attention-dropout 0
  --hidden-dropout 0
  --attention-softmax-in-fp32
  # MLA on the full-attention layers (NoPE in K3; the rope head dim is still part of the layout)
  --multi-latent-attention
  --q-lora-rank "$K3_Q_LORA_RANK"
  --kv-lora-rank "$K3_KV_LORA_RANK"
  --qk-head-dim "$K3_QK_HEAD_DIM"
  --qk-pos-emb-head-dim "$K3_QK_POS_HEAD_DIM"
  --v-head-dim "$K3_V_HEAD_DIM"
  --qk-layernorm
  # latent MoE: routed experts on a latent width, shared experts; the first K3_FIRST_DENSE layers are dense
  --num-experts "$K3_EXPERTS"
  --moe-layer-freq "[0]*$K3_FIRST_DENSE+[1]*$((K3_NUM_LAYERS - K3_FIRST_DENSE))"
  --moe-ffn-hidden-size "$K3_MOE_FFN_HIDDEN"
  --moe-latent-size "$K3_MOE_LATENT"
  --moe-shared-expert-intermediate-size "$K3_SHARED_FFN_HIDDEN"
  --moe-router-topk "$K3_TOPK"
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 1.0
  --moe-router-dtype fp32
  --moe-router-load-balancing-type none
  --moe-aux-loss-coeff 0
  --moe-router-bias-update-rate 0
  --moe-token-dispatcher-type alltoall
  --moe-grouped-gemm
)
