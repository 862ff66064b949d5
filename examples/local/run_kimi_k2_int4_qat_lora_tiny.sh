#!/usr/bin/env bash
# Tiny CPU version of examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh (seed 003,
# Kimi K2.x INT4 QAT + LoRA with SkyRL). What runs here, on one CPU machine:
#   1. a tiny K2.x checkpoint (KimiK25ForConditionalGeneration) with INT4 pack-quantized experts in
#      the Kimi QAT convention (scale = amax / 7, q in [-7, 7]);
#   2. `kimi-rl dequantize`: the seed's one-time BF16 masters, verified tensor by tensor to be a fixed
#      point of the INT4 quantizer (SHOW_RTN=1 also shows an RTN checkpoint being refused, exit 2);
#   3. `kimi-rl check-numerics`: the INT4 checkpoint (dequantized exactly, in fp32) against its BF16
#      masters, which hold bf16(q * scale): the gap is the bf16 rounding of the masters, the same
#      rounding SkyRL's fake-quant applies, not a grid mismatch (the codes and scales are identical);
#   4. with DEMO_STEPS > 0, `kimi-rl demo --recipe skyrl-k2 --steps DEMO_STEPS` (the one-machine LoRA RL job as
#      this recipe trains: BF16 masters, fake-INT4 QAT experts, capacity-normalised expert LoRA, GRPO + TIS);
# and, printed for GPUs, the SkyRL command on one 8-GPU node with this tiny checkpoint.
#   bash examples/local/run_kimi_k2_int4_qat_lora_tiny.sh
#   DEMO_STEPS=20 ENGINES=reference,vllm bash examples/local/run_kimi_k2_int4_qat_lora_tiny.sh

KIMI_SCRIPT_NAME=examples/local/run_kimi_k2_int4_qat_lora_tiny.sh
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
kimi_local_knobs kimi_k2_int4_qat_lora
kimi_knob ENGINES "reference,reference@$OUT/tiny-k25-bf16"
kimi_knob DEMO_STEPS 2
kimi_knob SHOW_RTN 0

kimi_local_step "tiny Kimi K2.x checkpoint, INT4 experts in the Kimi QAT convention" \
  kimi_local_make_tiny k25 "$OUT/tiny-k25" --quant int4 --convention kimi
kimi_local_step "the seed's BF16 masters, verified as fixed points of the INT4 grid" \
  $KIMI_RL dequantize --input "$OUT/tiny-k25" --output "$OUT/tiny-k25-bf16" --scale-divisor 7.0 --q-min -7
if [[ "$SHOW_RTN" == 1 ]]; then
  kimi_local_step "an RTN checkpoint (amax / 7.5) is not its own fixed point: dequantize must refuse it (exit 2)" \
    kimi_local_make_tiny k25 "$OUT/tiny-k25-rtn" --quant int4 --convention rtn
  set +e
  $KIMI_RL dequantize --input "$OUT/tiny-k25-rtn" --output "$OUT/tiny-k25-rtn-bf16"
  rc=$?
  set -e
  if [[ "$rc" != 2 ]]; then echo "error: expected exit 2 from dequantize on an RTN checkpoint, got $rc" >&2; exit 1; fi
  echo "(refused with exit 2, as expected)"
fi
numerics_int4() {
  # check-numerics exits 3 when a pair is flagged. Here the fp32 reference dequantizes INT4 exactly
  # (q * scale in fp32) while BF16 masters hold bf16(q * scale): a 3-bit code times an 8-bit bf16
  # mantissa does not always fit bf16, so that pair differs by the rounding (about 1e-3 in logprob
  # on this model). It is reported, not fatal; any other failure is.
  local rc=0
  $KIMI_RL check-numerics --model "$OUT/tiny-k25" --engines "$ENGINES" --tokens "$TOKENS" --batch 1 \
    --dtype "$NUMERICS_DTYPE" --out "$OUT/numerics" || rc=$?
  if [[ "$rc" == 3 ]]; then
    echo "(flagged pair above: exact fp32 INT4 dequantization vs bf16-rounded masters, see the comment in this script)"
  elif [[ "$rc" != 0 ]]; then
    return "$rc"
  fi
}
kimi_local_step "logprobs on the INT4 checkpoint (exact fp32 dequant) vs on its BF16 masters (and any installed engine)" \
  numerics_int4
if (( DEMO_STEPS > 0 )); then
  kimi_local_step "kimi-rl demo --recipe skyrl-k2: this recipe's LoRA RL on a tiny Kimi model on this CPU" \
    $KIMI_RL demo --recipe skyrl-k2 --steps "$DEMO_STEPS" --out "$OUT/demo"
fi

kimi_local_show_cluster_command examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh \
  NUM_NODES=1 GPUS_PER_NODE=8 NUM_INFERENCE_ENGINES=4 INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE=2 \
  MEGATRON_TP=1 MEGATRON_CP=1 MEGATRON_EP=8 MAX_MODEL_LEN=4096 MAX_PROMPT_LENGTH=512 \
  TRAIN_BATCH_SIZE=8 MINI_BATCH_SIZE=8 N_SAMPLES_PER_PROMPT=4 EVAL_N_SAMPLES_PER_PROMPT=1 LORA_RANK=8 LORA_ALPHA=8 \
  LOGGER=console MODEL_PATH="$OUT/tiny-k25" EXPORT_DIR="$OUT/exports" CKPT_DIR="$OUT/ckpts" \
  SKYRL_DIR=/path/to/SkyRL
echo
echo "done: tiny K2.x checkpoint, BF16 masters, numerics report in $OUT/numerics; the cluster command was printed, not run."
