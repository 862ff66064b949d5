"""Block spec of Kimi K2.x / K3 / K3.1 for megatron-core's ``TransformerBlock`` / ``GPTModel``.

:func:`get_spec` is miles' hook (users type ``--spec kimi_megatron_plugin.spec get_spec``, which
re-exports it); :func:`get_block_spec` is the same without miles' ``args``. The spec is a
``TransformerBlockSubmodules`` with one layer spec per layer of this pipeline (and virtual) stage:

=====================  ==========================================================================
slot                   module
=====================  ==========================================================================
layer                  ``TransformerLayer`` (K2.x) / :class:`~.attn_res.KimiAttnResLayer` (K3, K3.1)
input/pre-MLP norms    :class:`~.layers.KimiRMSNorm`
self_attention         :class:`~.layers.KimiMLA` (``MLASelfAttention`` + :class:`~.layers.KimiCoreAttention`)
                       or :class:`~.layers.KimiKDA` on ``linear_attn_config.kda_layers``
mlp                    :class:`~.mlp.KimiMLP` (dense, ``first_k_dense_replace``) or
                       :class:`~.mlp.KimiMoELayer` (``TopKRouter`` + :class:`~.experts.KimiExperts`
                       + :class:`~.mlp.KimiSharedMLP`)
final norm             :class:`~.layers.KimiRMSNorm` / :class:`~.attn_res.KimiOutputNorm` (K3: output
                       attention-residual aggregator + norm)
=====================  ==========================================================================

Every Kimi module gets the parsed :class:`kimi_core.config.KimiConfig` as ``kimi`` through the
spec's ``params``, so the megatron config needs no extra fields.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from kimi_core.config import KimiConfig, load_config
from kimi_megatron_plugin.models.attn_res import KimiAttnResLayer, KimiOutputNorm
from kimi_megatron_plugin.models.experts import KimiExperts
from kimi_megatron_plugin.models.layers import KimiCoreAttention, KimiKDA, KimiMLA, KimiRMSNorm
from kimi_megatron_plugin.models.mlp import KimiMLP, KimiMoELayer, KimiRouter, KimiSharedMLP

__all__ = ["get_spec", "get_block_spec", "layer_spec"]


def layer_spec(kimi: KimiConfig, layer: int, expert_mode: str = "w4a16", **expert_kwargs) -> ModuleSpec:
    """Spec of 0-based global ``layer``."""
    if kimi.is_kda_layer(layer):
        attn = ModuleSpec(module=KimiKDA, params={"kimi": kimi})
    else:
        attn = ModuleSpec(
            module=KimiMLA,
            params={"kimi": kimi, "attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear,
                linear_q_down_proj=ColumnParallelLinear,
                linear_q_up_proj=ColumnParallelLinear,
                linear_kv_down_proj=ColumnParallelLinear,
                linear_kv_up_proj=ColumnParallelLinear,
                core_attention=KimiCoreAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=KimiRMSNorm,
                kv_layernorm=KimiRMSNorm,
            ),
        )
    if kimi.is_moe_layer(layer):
        experts = ModuleSpec(module=KimiExperts, params={"kimi": kimi, "mode": expert_mode, **expert_kwargs})
        shared = ModuleSpec(module=KimiSharedMLP, params={"kimi": kimi}) if kimi.n_shared_experts else None
        mlp = ModuleSpec(
            module=KimiMoELayer,
            params={"kimi": kimi},
            submodules=MoESubmodules(experts=experts, shared_experts=shared, router=KimiRouter),
        )
    else:
        mlp = ModuleSpec(module=KimiMLP, params={"kimi": kimi})
    sub = TransformerLayerSubmodules(
        input_layernorm=KimiRMSNorm,
        self_attention=attn,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=KimiRMSNorm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
    )
    if kimi.attn_res_block_size:
        return ModuleSpec(module=KimiAttnResLayer, params={"kimi": kimi}, submodules=sub)
    return ModuleSpec(module=TransformerLayer, submodules=sub)


def get_block_spec(
    kimi: KimiConfig,
    config,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    expert_mode: str = "w4a16",
    **expert_kwargs,
) -> TransformerBlockSubmodules:
    """Layer specs of this rank's (virtual) pipeline stage plus the final norm."""
    if config.num_layers != kimi.num_hidden_layers:
        raise ValueError(f"--num-layers {config.num_layers} != config.json num_hidden_layers {kimi.num_hidden_layers}")
    if config.hidden_size != kimi.hidden_size:
        raise ValueError(f"--hidden-size {config.hidden_size} != config.json hidden_size {kimi.hidden_size}")
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    n = get_num_layers_to_build(config, vp_stage, pp_rank)
    specs = [layer_spec(kimi, offset + i, expert_mode, **expert_kwargs) for i in range(n)]
    norm = ModuleSpec(module=KimiOutputNorm, params={"kimi": kimi}) if kimi.attn_res_block_size else KimiRMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def get_spec(args, config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """miles' ``--spec`` hook: ``get_spec(args, config, vp_stage)``.

    Reads ``config.json`` from ``args.hf_checkpoint``; the expert mode from the optional
    ``args.kimi_expert_mode`` (``w4a16`` default, ``qat``, ``dense``) and the QAT grid from
    ``args.kimi_qat_scale_divisor`` / ``args.kimi_qat_q_min`` (7.0 / -7).
    """
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise ValueError(
            "kimi_megatron_plugin.spec.get_spec: --hf-checkpoint is required (its config.json "
            "describes the Kimi layers)"
        )
    kimi = load_config(path)
    _align_config_with_checkpoint(config, kimi)
    mode = getattr(args, "kimi_expert_mode", None) or "w4a16"
    kw = {}
    if mode == "qat":
        kw = {
            "scale_divisor": float(getattr(args, "kimi_qat_scale_divisor", None) or 7.0),
            "q_min": int(getattr(args, "kimi_qat_q_min", None) or -7),
        }
    return get_block_spec(kimi, config, vp_stage=vp_stage, expert_mode=mode, **kw)


def _align_config_with_checkpoint(config, kimi: KimiConfig) -> None:
    """Align miles' ``config`` (built from its command line) with config.json where our layers read it.

    ``moe_latent_size`` (``--moe-latent-size``) is checked against config.json and cleared: K3's latent
    projections are :class:`KimiMoELayer`'s own modules, and megatron's ``MoELayer`` would build TransformerEngine
    ones (it asserts TE when the field is set). The RoPE fields (``rope_type``, base, YaRN scaling, mscale: what
    MLA's rotary table and softmax scale read) are set from config.json as our provider sets them; the
    command line has no flag for K3's NoPE.
    """
    from kimi_megatron_plugin.models.provider import _rope_kwargs  # provider imports this module

    got = getattr(config, "moe_latent_size", None)
    if got and got != kimi.routed_expert_hidden_size:
        raise ValueError(
            f"--moe-latent-size {got} != config.json routed_expert_hidden_size {kimi.routed_expert_hidden_size}"
        )
    if got:
        config.moe_latent_size = None
    for name, value in _rope_kwargs(kimi).items():
        setattr(config, name, value)
