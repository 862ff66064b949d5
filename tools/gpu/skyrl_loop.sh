#!/usr/bin/env bash
# SkyRL's own loop (main_base: Ray, RayPPOTrainer, its vLLM generator, its Megatron policy worker) on one GPU,
# colocated, with our plugins: a tiny-but-real-shaped Kimi K2 (make-tiny --size small, INT4 experts), a few
# steps of DAPO-style LoRA RL on the token-set task, the adapter synced into vLLM every step.
#
# Run on the GPU machine in the project root, after the SkyRL staging of tools/gpu/README-skyrl.md (the site
# folder in /tmp/site). Writes into OUT (default $OUT): loop.log (everything), rollouts0.json (step 0's tokens and
# the engine's logprobs), floor.json (those tokens against kimi_core.reference), then summarizes with
# tools/gpu/skyrl_loop_check.py. Knobs: STEPS (3), EXPERT_WEIGHTS (int4 | bf16), QAT (0 | 1, with bf16),
# LOOP_TIMEOUT (seconds for main_base, 420), EXTRA (more overrides).
set -uo pipefail
OUT=${OUT:-/tmp/skyrl-out}
SITE=${SITE:-/tmp/site}
STEPS=${STEPS:-3}
EXPERT_WEIGHTS=${EXPERT_WEIGHTS:-int4}
QAT=${QAT:-0}
CKPT=${CKPT:-/tmp/tiny-k2-small}
DATA=${DATA:-/tmp/tiny-task}
mkdir -p "$OUT"
t0=$(date +%s)
step() { local t=$(date +%s); echo "time $1 $((t - t0))"; t0=$t; }

# small wheels the staging lacks (jaxtyping for SkyRL's Megatron strategy, accelerate for Megatron-Bridge, ...)
# or replaces (megatron-core built from SkyRL's locked git revision): installed beside the site, then moved in
# package by package; `megatron` is a namespace shared by megatron-core and megatron-bridge, so its
# subpackages are replaced one by one
if compgen -G ".gpu/extra/*.whl" > /dev/null; then
  X=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$X" .gpu/extra/*.whl \
    || { echo "the wheels in .gpu/extra did not install"; exit 1; }
  for d in "$X"/*; do
    n=$(basename "$d")
    case "$n" in
      *.dist-info) rm -rf "$SITE/${n%%-*}"-*.dist-info ;;
    esac
    if [ -d "$d" ] && [ ! -f "$d/__init__.py" ] && [ "${n%.dist-info}" = "$n" ] && [ -d "$SITE/$n" ]; then
      for sub in "$d"/*; do rm -rf "$SITE/$n/$(basename "$sub")" && mv "$sub" "$SITE/$n/"; done
    else
      rm -rf "${SITE:?}/$n" && mv "$d" "$SITE/"
    fi
  done
  rm -rf "$X"
  echo "extra wheels: $(cd .gpu/extra && ls *.whl | tr '\n' ' ')"
fi
python3 tools/gpu/write_entry_points.py "$SITE" > /dev/null
if [ "${NO_TE:-0}" = 1 ]; then  # without TransformerEngine: our model uses the local spec, kimi's te_stub lets Bridge import
  mkdir -p /tmp/te-off && mv "$SITE"/transformer_engine* /tmp/te-off/ 2> /dev/null || true
fi
export PYTHONPATH=$SITE:$PWD CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ ! -f /tmp/cublas/libcublasLt.so.13 ] || export LD_PRELOAD=/tmp/cublas/libcublasLt.so.13:/tmp/cublas/libcublas.so.13
export SKYRL_DUMP_INFRA_LOG_TO_STDOUT=1 SKYRL_PYTHONPATH_EXPORT=1 RAY_DEDUP_LOGS=0 KIMI_SKYRL_DUMP_ROLLOUTS=$OUT/rollouts0.json
export VLLM_LOGGING_LEVEL=INFO
rm -f "$KIMI_SKYRL_DUMP_ROLLOUTS"

while pgrep -f "kimi_rl_glue.cli (make-tiny|prepare-data)" > /dev/null; do sleep 2; done  # one started earlier
[ -f "$CKPT/config.json" ] || python3 -m kimi_rl_glue.cli make-tiny --model k2 --size small --quant int4 --out "$CKPT"
[ -f "$DATA/train.parquet" ] || python3 -m kimi_rl_glue.cli prepare-data --format skyrl --task token-set \
  --checkpoint "$CKPT" --prompts 64 --output "$DATA/train.parquet"
step setup

case "$EXPERT_WEIGHTS" in
  int4) EXPERTS=(trainer.policy.model.kimi.expert_weights=int4 trainer.policy.model.fake_int4_qat.enabled=false) ;;
  bf16) EXPERTS=(trainer.policy.model.kimi.expert_weights=bf16 trainer.policy.model.fake_int4_qat.enabled=$([ "$QAT" = 1 ] && echo true || echo false)
                 trainer.policy.model.fake_int4_qat.scale_divisor=7.0 trainer.policy.model.fake_int4_qat.q_min=-7) ;;
  *) echo "EXPERT_WEIGHTS=$EXPERT_WEIGHTS: int4 or bf16"; exit 2 ;;
esac

timeout "${LOOP_TIMEOUT:-420}" python3 -m skyrl.train.entrypoints.main_base \
  trainer.override_entrypoint=kimi_rl_glue.skyrl.main \
  trainer.strategy=megatron trainer.placement.colocate_all=true \
  trainer.placement.policy_num_nodes=1 trainer.placement.policy_num_gpus_per_node=1 \
  trainer.policy.model.path="$CKPT" "${EXPERTS[@]}" \
  trainer.policy.model.kimi.normalize_moe_lora=true \
  trainer.policy.model.lora.rank=32 trainer.policy.model.lora.alpha=64 \
  "trainer.policy.model.lora.target_modules=['linear_proj','linear_fc1','linear_fc2']" \
  trainer.policy.model.lora.lora_sync_path=/tmp/skyrl_lora_sync \
  trainer.policy.megatron_config.lora_config.merge_lora=false \
  trainer.policy.megatron_config.tensor_model_parallel_size=1 trainer.policy.megatron_config.pipeline_model_parallel_size=1 \
  trainer.policy.megatron_config.context_parallel_size=1 trainer.policy.megatron_config.expert_model_parallel_size=1 \
  trainer.policy.megatron_config.expert_tensor_parallel_size=1 \
  trainer.policy.optimizer_config.lr=2e-3 trainer.policy.optimizer_config.num_warmup_steps=0 \
  trainer.flash_attn=false trainer.gradient_checkpointing=false \
  trainer.algorithm.advantage_estimator=grpo trainer.algorithm.policy_loss_type=kimi_dapo \
  trainer.algorithm.use_kl_loss=false trainer.algorithm.off_policy_correction.tis_ratio_type=token \
  trainer.algorithm.overlong_buffer_len=16 \
  generator.inference_engine.backend=vllm generator.inference_engine.run_engines_locally=true \
  generator.inference_engine.num_engines=1 generator.inference_engine.tensor_parallel_size=1 \
  generator.inference_engine.gpu_memory_utilization=0.3 generator.inference_engine.weight_sync_backend=nccl \
  'generator.inference_engine.engine_init_kwargs={"max_model_len": 512}' \
  generator.batched=true generator.n_samples_per_prompt=8 generator.sampling_params.max_generate_length=64 \
  generator.sampling_params.logprobs=0 \
  environment.env_class=kimi_token_set \
  "data.train_data=['$DATA/train.parquet']" "data.val_data=['$DATA/train.parquet']" \
  trainer.train_batch_size=8 trainer.policy_mini_batch_size=8 \
  trainer.micro_forward_batch_size_per_gpu=16 trainer.micro_train_batch_size_per_gpu=16 trainer.max_prompt_length=64 \
  trainer.epochs=1 trainer.max_training_steps="$STEPS" trainer.eval_interval=0 trainer.eval_before_train=false \
  trainer.logger=console trainer.ckpt_interval=0 trainer.hf_save_interval=0 trainer.resume_mode=none \
  trainer.export_path=/tmp/skyrl/export trainer.ckpt_path=/tmp/skyrl/ckpt trainer.log_path=/tmp/skyrl/logs \
  ${EXTRA:-} > "$OUT/loop.log" 2>&1
rc=$?
echo "main_base rc $rc"
step loop
[ -f "$KIMI_SKYRL_DUMP_ROLLOUTS" ] && python3 tools/gpu/skyrl_floor.py "$CKPT" "$KIMI_SKYRL_DUMP_ROLLOUTS" "$OUT/floor.json"
step floor
python3 tools/gpu/skyrl_loop_check.py "$OUT/loop.log" --floor "$OUT/floor.json" --json "$OUT/summary.json" || true
tail -c 6000 "$OUT/loop.log" | grep -v "^\s*$" | tail -60
exit $rc
