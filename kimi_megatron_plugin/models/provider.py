"""Kimi config -> megatron-core ``MLATransformerConfig``, and a model provider usable without miles.

:func:`transformer_config` translates a :class:`kimi_core.config.KimiConfig` (parsed HF
``config.json``) into megatron-core's config; Kimi-only facts (KDA layout, attention-residual
block, latent MoE, SiTU betas, indexer) stay in the ``KimiConfig``, which the spec hands to each
module. :func:`build_model` returns a stock ``GPTModel`` whose decoder is built from
:func:`kimi_megatron_plugin.models.spec.get_block_spec`; :class:`KimiModelProvider` wraps it in the
``(pre_process, post_process, vp_stage) -> model`` signature of megatron's ``get_model``.

Example::

    from kimi_megatron_plugin import checkpoint, cpu_parallel
    from kimi_megatron_plugin.models import provider

    cpu_parallel.initialize_cpu_parallel()                   # or your own megatron init
    model = provider.build_model_from_hf("/ckpt/Kimi-K3")    # GPTModel, fp32 by default
    checkpoint.load_hf_checkpoint(model, "/ckpt/Kimi-K3")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from kimi_core.config import KimiConfig, load_config
from kimi_megatron_plugin.models.spec import get_block_spec

__all__ = ["transformer_config", "build_model", "build_model_from_hf", "KimiModelProvider"]


def _rope_kwargs(kimi: KimiConfig) -> dict:
    if kimi.mla_use_nope:
        # NoPE: the rotary table is replaced by a zero-angle one in KimiMLA; scale stays d^-1/2
        return dict(rope_type="rope", rotary_base=kimi.rope_theta, rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    rs = kimi.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return dict(rope_type="rope", rotary_base=kimi.rope_theta, rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported (yarn or none)")
    return dict(
        rope_type="yarn",
        rotary_base=kimi.rope_theta,
        rotary_scaling_factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rs.get("beta_fast") or 32),
        beta_slow=float(rs.get("beta_slow") or 1),
        mscale=float(rs.get("mscale") or 1.0),
        mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
    )


def transformer_config(
    kimi: KimiConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    **overrides,
) -> MLATransformerConfig:
    """The ``MLATransformerConfig`` of ``kimi`` (fusions off, dropout 0, allgather dispatcher, ETP 1).

    :param params_dtype: fp32 for numerics checks, bf16 for training.
    :param overrides: any ``MLATransformerConfig`` field, applied last.
    """
    L = num_layers or kimi.num_hidden_layers
    n_shared = kimi.n_shared_experts
    kw = dict(
        num_layers=L,
        hidden_size=kimi.hidden_size,
        num_attention_heads=kimi.num_attention_heads,
        ffn_hidden_size=kimi.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=kimi.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        multi_latent_attention=True,
        qk_layernorm=True,  # MLA latent norms; 0.19.2 rejects them otherwise
        q_lora_rank=kimi.q_lora_rank,
        kv_lora_rank=kimi.kv_lora_rank,
        qk_head_dim=kimi.qk_nope_head_dim,
        qk_pos_emb_head_dim=kimi.qk_rope_head_dim,
        v_head_dim=kimi.v_head_dim,
        num_moe_experts=kimi.n_routed_experts,
        moe_router_topk=kimi.num_experts_per_tok,
        moe_ffn_hidden_size=kimi.moe_intermediate_size,
        moe_shared_expert_intermediate_size=kimi.moe_intermediate_size * n_shared if n_shared else None,
        moe_layer_freq=[1 if kimi.is_moe_layer(i) else 0 for i in range(L)],
        moe_router_score_function=kimi.scoring_func,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=kimi.routed_scaling_factor,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if not kimi.norm_topk_prob and kimi.num_experts_per_tok > 1:
        raise ValueError("config.json: norm_topk_prob=False is not expressible with megatron's sigmoid router")
    kw.update(_rope_kwargs(kimi))
    kw.update(overrides)
    return MLATransformerConfig(**kw)


def build_model(
    kimi: KimiConfig,
    config: MLATransformerConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    expert_mode: str = "w4a16",
    **expert_kwargs,
) -> GPTModel:
    """A ``GPTModel`` for this rank's pipeline stage with the Kimi block spec.

    :param expert_mode: ``w4a16`` | ``qat`` | ``dense`` (:mod:`kimi_megatron_plugin.models.experts`).
    :param expert_kwargs: ``scale_divisor``, ``q_min``, ``quant_format`` for the experts.
    """
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    spec = get_block_spec(kimi, config, vp_stage=vp_stage, expert_mode=expert_mode, **expert_kwargs)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=kimi.vocab_size,
        max_sequence_length=kimi.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=kimi.tie_word_embeddings,
        position_embedding_type="none",
        vp_stage=vp_stage,
    )
    model.kimi_config = kimi
    return model


def build_model_from_hf(path: str | os.PathLike, **kw) -> GPTModel:
    """``build_model`` for the ``config.json`` in ``path``; ``kw`` split between config and model."""
    kimi = load_config(path)
    model_keys = {"pre_process", "post_process", "vp_stage", "expert_mode", "scale_divisor", "q_min", "quant_format"}
    mkw = {k: kw.pop(k) for k in list(kw) if k in model_keys}
    cfg = transformer_config(kimi, **kw)
    return build_model(kimi, cfg, **mkw)


@dataclass
class KimiModelProvider:
    """Callable model provider: ``provider(pre_process, post_process, vp_stage=None) -> GPTModel``.

    :param kimi: parsed config (or use :meth:`from_hf`); ``config``: megatron config (default:
        :func:`transformer_config` with the current parallel sizes).
    """

    kimi: KimiConfig
    config: MLATransformerConfig | None = None
    expert_mode: str = "w4a16"
    expert_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, path, **kw) -> KimiModelProvider:
        return cls(kimi=load_config(path), **kw)

    def __post_init__(self):
        if self.config is None:
            self.config = transformer_config(
                self.kimi,
                tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
                expert_parallel=parallel_state.get_expert_model_parallel_world_size(),
                context_parallel_size=parallel_state.get_context_parallel_world_size(),
            )

    def __call__(self, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> GPTModel:
        return build_model(
            self.kimi, self.config, pre_process, post_process, vp_stage, self.expert_mode, **self.expert_kwargs
        )
