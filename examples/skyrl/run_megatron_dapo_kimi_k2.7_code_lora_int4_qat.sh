#!/usr/bin/env bash
# Kimi K2.7-Code (1T DeepSeek-V3-architecture MoE, INT4 QAT experts) with SkyRL: DAPO-style GRPO,
# LoRA, INT4 rollouts, TIS. Seed 003 ("Kimi K2.x: 1T-param RL with INT4 rollouts + LoRA").
# 2 nodes x 8 GPUs, colocated: one vLLM engine per node (TP8) serving the INT4 release with the
# adapter hot-loaded after every step (merge_lora=false); Megatron TP2 x CP8 (DP1), EP16, ETP1, PP1;
# the full 262,144-token context (8k prompt). docs/recipes/kimi_k2_int4_qat_lora.md has the story.
#
# What our plugins replace, compared with the seed (trainer.override_entrypoint=kimi_rl_glue.skyrl.main;
# tools/gpu/skyrl_loop.sh runs the same pieces on one GPU with a tiny K2):
#   - SkyRL's own loop (main_base, RayPPOTrainer, its vLLM generator, its Megatron policy worker) with
#     kimi_rl_glue.skyrl.policy_worker in place of SkyRL's policy worker: the K2.x model through
#     kimi_megatron_plugin's Megatron-Bridge bridge, Kimi LoRA on attention-out and every MLP including the routed
#     experts (Bridge PEFT would skip them), the adapter exported per expert each step and loaded into vLLM under
#     SkyRL's adapter name (prefix cache reset by SkyRL before the sync and by kimi_vllm_plugin on in-place reloads).
#   - No BF16 copy (default EXPERT_WEIGHTS=int4): the frozen routed experts stay the release's packed INT4 bytes
#     (W4A16, about 0.56 B/param), dequantized inside the grouped GEMM: for Kimi-QAT checkpoints exactly the grid vLLM
#     serves, so there is no fake-quant pass and no dequantize step. EXPERT_WEIGHTS=bf16 is the seed's path: BF16
#     masters (BF16_BASE_PATH, or dequantized from the release at load) fake-quantized by our experts (QAT_MODE=on).
#   - vLLM through its plugin entry point (VLLM_PLUGINS=kimi): LoRA-capable K2.x classes with MoE LoRA; any adapter
#     folder vLLM loads for them is prepared by the plugin (rank_pattern / alpha_pattern folded, expert layouts).
#   - Our DAPO losses (kimi_dapo) and the overlong penalty, through SkyRL's registries.
# Not yet run: the seed's multi-node layout below (TP2 CP8 EP16). Under EP the per-expert LoRA factors are marked as
# Megatron expert parameters (reduced over expert-DP like Megatron's own expert weights); the shared-outer layout is
# refused under EP. What has run: tools/gpu/README-skyrl.md.
#
# Usage: export VLLM_PLUGINS=kimi in the shell that runs `ray start` on every node (Ray workers
# inherit the raylet's environment), start Ray on both nodes, then on the head node:
#   bash examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh [extra key=value ...]
#   DRY_RUN=1 bash examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh   # print only
# Smoke test of a fresh cluster (the seed's recipe):
#   LOGGER=console MAX_RESPONSE_LENGTH=2048 TRAIN_BATCH_SIZE=8 MINI_BATCH_SIZE=8 N_SAMPLES_PER_PROMPT=4 \
#     bash examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh trainer.max_training_steps=2
# Ablation: QAT_MODE=off turns TIS (and, with EXPERT_WEIGHTS=bf16, the fake-quant) off.

KIMI_SCRIPT_NAME=examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

# --- scale knobs (defaults: the seed's 2 x 8 run) -------------------------------------------------
kimi_knob NUM_NODES 2
kimi_knob GPUS_PER_NODE 8
kimi_knob NUM_INFERENCE_ENGINES 2
kimi_knob INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE 8
kimi_knob MEGATRON_TP 2
kimi_knob MEGATRON_PP 1
kimi_knob MEGATRON_CP 8
kimi_knob MEGATRON_EP 16
kimi_knob MEGATRON_ETP 1
kimi_knob MAX_MODEL_LEN 262144
kimi_knob MAX_PROMPT_LENGTH $(( 1024 * 8 ))
kimi_knob MAX_RESPONSE_LENGTH $(( MAX_MODEL_LEN - MAX_PROMPT_LENGTH ))
kimi_knob TRAIN_BATCH_SIZE 16
kimi_knob MINI_BATCH_SIZE 16
kimi_knob N_SAMPLES_PER_PROMPT 8
kimi_knob EVAL_N_SAMPLES_PER_PROMPT 8
kimi_knob LORA_RANK 32
kimi_knob LORA_ALPHA 32
kimi_knob NORMALIZE_MOE_LORA true      # expert rank = rank // top-k (32 -> 4): the per-step export stays small
kimi_knob LR 1e-5
kimi_knob OVERLONG_BUFFER_LEN $(( 1024 * 4 ))
kimi_knob GPU_MEMORY_UTILIZATION 0.7
kimi_knob OPTIMIZER_OFFLOAD false
kimi_knob QAT_MODE on                  # on | off (off: no TIS, no fake-quant: the uncorrected mismatch)
kimi_knob EXPERT_WEIGHTS int4          # int4: packed INT4 experts in the trainer | bf16: the seed's masters
kimi_knob LOGGER wandb
# --- paths ------------------------------------------------------------------------------------------
kimi_knob SKYRL_DIR "$PWD"                                  # NovaSky-AI/SkyRL checkout with its venv
kimi_knob MODEL_PATH moonshotai/Kimi-K2.7-Code              # the INT4 release, served as-is
kimi_knob BF16_BASE_PATH /data/skyrl/models/Kimi-K2.7-Code-BF16   # only for EXPERT_WEIGHTS=bf16
kimi_knob DATA_DIR "$HOME/data/dapo"
kimi_knob TRAIN_FILE "$DATA_DIR/dapo-math-17k-cleaned.parquet"
kimi_knob TEST_FILE "$DATA_DIR/aime-2024-cleaned.parquet"
kimi_knob EXPORT_DIR "$HOME/exports"
kimi_knob CKPT_DIR "$HOME/ckpts"

kimi_divides $(( MEGATRON_TP * MEGATRON_PP * MEGATRON_CP )) $(( NUM_NODES * GPUS_PER_NODE )) \
  "MEGATRON_TP*MEGATRON_PP*MEGATRON_CP vs NUM_NODES*GPUS_PER_NODE"
if (( NUM_INFERENCE_ENGINES * INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE != NUM_NODES * GPUS_PER_NODE )); then
  echo "error: colocated: NUM_INFERENCE_ENGINES*INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE must equal NUM_NODES*GPUS_PER_NODE" >&2
  exit 2
fi
case "$QAT_MODE" in
  on) TIS_TYPE=token; FAKE_QUANT=true ;;
  off) TIS_TYPE=null; FAKE_QUANT=false ;;
  *) echo "error: QAT_MODE=$QAT_MODE: expected on or off" >&2; exit 2 ;;
esac
case "$EXPERT_WEIGHTS" in
  int4)   # the experts are the served grid already: SkyRL's fake-quant pass has nothing to do
    EXPERT_ARGS=(trainer.policy.model.kimi.expert_weights=int4 trainer.policy.model.fake_int4_qat.enabled=false) ;;
  bf16)
    EXPERT_ARGS=(trainer.policy.model.kimi.expert_weights=bf16
                 trainer.policy.model.fake_int4_qat.enabled=$FAKE_QUANT
                 trainer.policy.model.fake_int4_qat.group_size=32
                 trainer.policy.model.fake_int4_qat.scale_divisor=7.0
                 trainer.policy.model.fake_int4_qat.q_min=-7
                 trainer.policy.model.fake_int4_qat.bf16_base_path="$BF16_BASE_PATH") ;;
  *) echo "error: EXPERT_WEIGHTS=$EXPERT_WEIGHTS: expected int4 or bf16" >&2; exit 2 ;;
esac
RUN_SUFFIX="${EXPERT_WEIGHTS}_qat_${QAT_MODE}"

kimi_env VLLM_PLUGINS "$KIMI_VLLM_PLUGIN_NAME"                 # loads kimi_vllm_plugin in every vLLM process
kimi_env VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS 3600                # engine wake-up plus 262k-token prefills
kimi_env SKYRL_WAIT_UNTIL_INFERENCE_SERVER_HEALTHY_TIMEOUT_S 3600   # cold INT4 load + CUDA-graph capture > 600 s
kimi_env SKYRL_LD_LIBRARY_PATH_EXPORT 1
kimi_env UV_PROJECT_ENVIRONMENT "$SKYRL_DIR/.venv"
if [[ "$EXPERT_WEIGHTS" == bf16 ]]; then
  kimi_env SKYRL_FROZEN_OFFLOAD_DIR /data/skyrl/frozen-offload   # the BF16 masters leave the GPU while engines generate
fi

# vLLM engine: max_model_len, decode-only CUDA graphs, FlashInfer MLA prefill (the default FA4
# CuTe-DSL prefill does not work with the locked nvidia-cutlass-dsl).
ENGINE_INIT_KWARGS="{\"max_model_len\": $MAX_MODEL_LEN, \"compilation_config\": {\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}, \"attention_config\": {\"mla_prefill_backend\": \"FLASHINFER\"}}"

OVERRIDES=(
  trainer.override_entrypoint="$KIMI_SKYRL_ENTRYPOINT"
  data.train_data="['$TRAIN_FILE']"
  data.val_data="['$TEST_FILE']"
  trainer.strategy=megatron
  trainer.placement.colocate_all=true
  trainer.placement.policy_num_nodes="$NUM_NODES"
  trainer.placement.policy_num_gpus_per_node="$GPUS_PER_NODE"
  # model: the INT4 release, text only, LoRA on attention-out and every MLP including the routed experts
  trainer.policy.model.path="$MODEL_PATH"
  "${EXPERT_ARGS[@]}"
  trainer.policy.language_model_only=true
  generator.inference_engine.language_model_only=true
  trainer.policy.model.lora.rank="$LORA_RANK"
  trainer.policy.model.lora.alpha="$LORA_ALPHA"
  trainer.policy.model.lora.target_modules="['linear_proj','linear_fc1','linear_fc2']"
  trainer.policy.megatron_config.lora_config.merge_lora=false
  trainer.policy.model.kimi.normalize_moe_lora="$NORMALIZE_MOE_LORA"
  trainer.flash_attn=false
  trainer.fused_lm_head_logprob=true
  # Megatron layout
  trainer.policy.megatron_config.tensor_model_parallel_size="$MEGATRON_TP"
  trainer.policy.megatron_config.pipeline_model_parallel_size="$MEGATRON_PP"
  trainer.policy.megatron_config.context_parallel_size="$MEGATRON_CP"
  trainer.policy.megatron_config.expert_model_parallel_size="$MEGATRON_EP"
  trainer.policy.megatron_config.expert_tensor_parallel_size="$MEGATRON_ETP"
  trainer.policy.megatron_config.optimizer_config_kwargs.optimizer_cpu_offload="$OPTIMIZER_OFFLOAD"
  trainer.policy.megatron_config.optimizer_config_kwargs.overlap_cpu_optimizer_d2h_h2d="$OPTIMIZER_OFFLOAD"
  trainer.policy.megatron_config.optimizer_config_kwargs.use_precision_aware_optimizer="$OPTIMIZER_OFFLOAD"
  trainer.policy.megatron_config.optimizer_config_kwargs.optimizer_offload_fraction=1.0
  # DAPO: dual-clip with clip-higher, token-mean loss, soft overlong punishment, no KL; TIS on the rollout log-probs
  trainer.algorithm.advantage_estimator=grpo
  trainer.algorithm.policy_loss_type=dual_clip
  trainer.algorithm.eps_clip_low=0.2
  trainer.algorithm.eps_clip_high=0.28
  trainer.algorithm.clip_ratio_c=10.0
  trainer.algorithm.loss_reduction=token_mean
  trainer.algorithm.use_kl_loss=false
  trainer.algorithm.overlong_buffer_len="$OVERLONG_BUFFER_LEN"
  trainer.algorithm.overlong_buffer_penalty_factor=1.0
  trainer.algorithm.off_policy_correction.tis_ratio_type="$TIS_TYPE"
  trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high=2.0
  generator.apply_overlong_filtering=false
  # sampling
  generator.n_samples_per_prompt="$N_SAMPLES_PER_PROMPT"
  generator.eval_n_samples_per_prompt="$EVAL_N_SAMPLES_PER_PROMPT"
  generator.sampling_params.temperature=1.0
  generator.sampling_params.top_p=1.0
  generator.sampling_params.max_generate_length="$MAX_RESPONSE_LENGTH"
  generator.eval_sampling_params.temperature=1.0
  generator.eval_sampling_params.top_p=0.7
  generator.eval_sampling_params.max_generate_length="$MAX_RESPONSE_LENGTH"
  generator.batched=true
  environment.env_class=aime
  # vLLM engines: one per node, colocated, adapter hot-loaded from disk after each step
  generator.inference_engine.backend=vllm
  generator.inference_engine.run_engines_locally=true
  generator.inference_engine.num_engines="$NUM_INFERENCE_ENGINES"
  generator.inference_engine.tensor_parallel_size="$INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE"
  generator.inference_engine.distributed_executor_backend=mp
  generator.inference_engine.weight_sync_backend=nccl
  generator.inference_engine.gpu_memory_utilization="$GPU_MEMORY_UTILIZATION"
  generator.inference_engine.enforce_eager=false
  generator.inference_engine.engine_init_kwargs="$ENGINE_INIT_KWARGS"
  # schedule and optimizer
  trainer.epochs=1
  trainer.update_epochs_per_batch=1
  trainer.train_batch_size="$TRAIN_BATCH_SIZE"
  trainer.policy_mini_batch_size="$MINI_BATCH_SIZE"
  trainer.micro_forward_batch_size_per_gpu=1
  trainer.micro_train_batch_size_per_gpu=1
  trainer.max_prompt_length="$MAX_PROMPT_LENGTH"
  trainer.policy.optimizer_config.lr="$LR"
  trainer.policy.optimizer_config.num_warmup_steps=0
  trainer.policy.optimizer_config.weight_decay=0.1
  trainer.policy.optimizer_config.max_grad_norm=1.0
  trainer.eval_batch_size=64
  trainer.eval_before_train=false
  trainer.eval_interval=0
  # logging and saving: adapters and optimizer state only (the frozen base is the release)
  trainer.logger="$LOGGER"
  trainer.project_name=kimi_k2_7_dapo_lora_int4
  trainer.run_name="dapo_lora_r${LORA_RANK}_kimi_k2.7_code_${NUM_NODES}node_${RUN_SUFFIX}"
  trainer.export_path="$EXPORT_DIR/dapo_lora_kimi_k2_7_${RUN_SUFFIX}"
  trainer.ckpt_path="$CKPT_DIR/dapo_lora_kimi_k2_7_${RUN_SUFFIX}"
  trainer.ckpt_interval=0
  trainer.hf_save_interval=0
  trainer.max_ckpts_to_keep=1
  trainer.resume_mode=none
)

kimi_launch uv run --directory "$SKYRL_DIR" --no-sync --extra megatron -m skyrl.train.entrypoints.main_base \
  "${OVERRIDES[@]}" "$@"
