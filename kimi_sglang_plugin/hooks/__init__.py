"""Ledger of every patch this plugin applies to SGLang, as ``HookRegistry`` hooks.

One :class:`HookSpec` per patched symbol: the target, the hook type, our hook function, **Why**,
**How**, the upstream PR and the condition to remove it, and the SGLang releases it was checked
against. :func:`check_targets` resolves each target without patching (a missing target is an
error that names it); ``tests/kimi_sglang_plugin/test_hooks.py`` fails when one disappears.

Files: :mod:`.dsa_gates` (K3.1 gates), :mod:`.lora_fixes` (the five fixes of
sgl-project/sglang#37704, "Kimi K3 colocated RL: LoRA fixes and in-place MXFP4 Marlin reload",
open against ``sglang-miles``), :mod:`kimi_sglang_plugin.moe_lora` (MoE LoRA on MXFP4 + SiTU).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

__all__ = ["HookSpec", "HOOKS", "check_targets", "resolve_hook", "resolve_target"]

PR_37704 = "sgl-project/sglang#37704"


@dataclass(frozen=True)
class HookSpec:
    """One ledger entry. ``fn`` is ``"module:function"`` of our hook."""

    name: str
    target: str
    kind: str  # "before" | "after" | "around" | "replace"
    fn: str
    why: str
    how: str
    upstream: str
    remove_when: str
    versions: tuple[str, ...] = ("0.5.23",)

    def hook_type(self):
        from sglang.srt.plugins.hook_registry import HookType

        return HookType(self.kind)


HOOKS: tuple[HookSpec, ...] = (
    # ------------------------------------------------------------------ K3.1 / DSA gates
    HookSpec(
        name="k31_is_deepseek_dsa",
        target="sglang.srt.configs.model_config.is_deepseek_dsa",
        kind="around", fn="kimi_sglang_plugin.hooks.dsa_gates:is_deepseek_dsa",
        why="is_deepseek_dsa keys DSA on a fixed architecture list without K3/K3.1; it selects the "
            "indexer in DeepseekV2AttentionMLA, the DSA KV/index pool and the DSA attention backends",
        how="AROUND: true when the original is, or when the config is K3.1 (K3.1 in architectures and "
            "index_topk set, config.is_k31_config); _propagate_patch rebinds the 45 'from ... import' sites",
        upstream="none (no K3.1 in sglang 0.5.23 or sglang-miles)",
        remove_when="SGLang lists KimiK31ForConditionalGeneration in is_deepseek_dsa",
    ),
    HookSpec(
        name="k31_index_head_dim",
        target="sglang.srt.configs.model_config.ModelConfig._derive_model_shapes",
        kind="after", fn="kimi_sglang_plugin.hooks.dsa_gates:derive_index_head_dim",
        why="the K3 branch of _derive_model_shapes sets MLA shapes but never index_head_dim, which the "
            "DSA index-K pool (pool_configurator) is sized by",
        how="AFTER: for a K3.1 config set model_config.index_head_dim = text_config.index_head_dim",
        upstream="none",
        remove_when="SGLang derives index_head_dim for K3-family DSA configs",
    ),
    HookSpec(
        name="k31_resolve_model_cls",
        target="sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        kind="around", fn="kimi_sglang_plugin.hooks.dsa_gates:resolve_model_cls",
        why="a K3.1 config reads as K3 to every arch gate (config.KimiK31Config), so the registry's "
            "first-arch fast path would build the stock K3 class",
        how="AROUND: when KimiK31ForConditionalGeneration is in the architectures list, return our "
            "class from ModelRegistry.models (resolved arch name K3.1)",
        upstream="none",
        remove_when="K3.1 is in-tree, or SGLang resolves by model_type",
    ),
    # ------------------------------------------------------------------ sgl-project/sglang#37704
    HookSpec(
        name="37704_1_num_shared_experts",
        target="sglang.srt.configs.kimi_linear.KimiLinearConfig.__init__",
        kind="after", fn="kimi_sglang_plugin.hooks.lora_fixes:alias_num_shared_experts",
        why="LoRA sizing reads only n_shared_experts (lora/utils.get_default_hidden_dim, "
            "lora/mem_pool._get_num_shared_experts and init_buffer, lora/lora.py); K3 configs say "
            "num_shared_experts, so shared-expert gate_up/down LoRA buffers get the dense MLP width",
        how="AFTER on the config constructor: set n_shared_experts = num_shared_experts when absent "
            "(one alias fixes every reader; K3 model code reads num_shared_experts only)",
        upstream=PR_37704 + " item 1",
        remove_when="SGLang LoRA reads num_shared_experts (or the PR lands in a release we pin)",
    ),
    HookSpec(
        name="37704_2_output_gate_lora_o_proj",
        target="sglang.srt.models.kimi_k3.KimiK3MLAAttention.__init__",
        kind="after", fn="kimi_sglang_plugin.hooks.lora_fixes:install_o_proj_input_transform",
        why="K3's MLA output gate (x * sigmoid(g_proj(h))) is applied by replacing o_proj.forward on "
            "the instance; RowParallelLinearWithLoRA calls base_layer.quant_method.apply directly, so "
            "with LoRA on o_proj the gate is silently dropped",
        how="AFTER: attach the gate as o_proj._kimi_lora_input_transform (same semantics as the "
            "instance wrapper); the paired hook below applies it inside the LoRA wrapper",
        upstream=PR_37704 + " item 2 (lora_input_transform)",
        remove_when="RowParallelLinearWithLoRA honours a base-layer input transform upstream",
    ),
    HookSpec(
        name="37704_2_row_parallel_lora_forward",
        target="sglang.srt.lora.layers.RowParallelLinearWithLoRA.forward",
        kind="around", fn="kimi_sglang_plugin.hooks.lora_fixes:row_parallel_lora_forward",
        why="see 37704_2_output_gate_lora_o_proj",
        how="AROUND: input_ = base_layer._kimi_lora_input_transform(input_) when present, so base GEMM "
            "and LoRA A both see the gated input (as without LoRA)",
        upstream=PR_37704 + " item 2",
        remove_when="as 37704_2_output_gate_lora_o_proj",
    ),
    HookSpec(
        name="37704_3_routed_expert_hidden_size",
        target="sglang.srt.lora.utils.get_default_hidden_dim",
        kind="around", fn="kimi_sglang_plugin.hooks.lora_fixes:latent_moe_hidden_dim",
        why="routed-expert LoRA buffers (gate_up_proj_moe, down_proj_moe) are sized with hidden_size; "
            "K3's latent MoE experts read and write routed_expert_hidden_size (3584 vs 7168)",
        how="AROUND: for those two modules use routed_expert_hidden_size when the config has one",
        upstream=PR_37704 + " item 3",
        remove_when="SGLang LoRA sizes MoE buffers from the experts' own width",
    ),
    HookSpec(
        name="37704_4_params_dtype_through_wrapper",
        target="sglang.srt.lora.layers.BaseLayerWithLoRA.__init__",
        kind="after", fn="kimi_sglang_plugin.hooks.lora_fixes:mirror_params_dtype",
        why="KimiK3LinearForCausalLM.post_load_weights reads self_attn.o_proj.params_dtype to "
            "precompile the KDA kernel; through a LoRA wrapper it is None and falls back to the "
            "(possibly quantized) weight dtype on every RL reload",
        how="AFTER: mirror base_layer.params_dtype onto the wrapper, as it already mirrors weight/bias",
        upstream=PR_37704 + " item 4",
        remove_when="BaseLayerWithLoRA forwards params_dtype upstream",
    ),
    HookSpec(
        name="37704_5_f_b_proj_registered_twice",
        target="sglang.srt.models.kimi_k3.KimiK3DeltaAttention._merge_bfa_weights",
        kind="around", fn="kimi_sglang_plugin.hooks.lora_fixes:merge_bfa_weights_once",
        why="`self._bfa_f_b_w = self.f_b_proj.weight` registers the Parameter a second time; "
            "named_parameters() then yields it as self_attn._bfa_f_b_w before self_attn.f_b_proj.weight, "
            "whose name disappears from params_dict, so RL weight reloads skip f_b_proj silently, and "
            "the second post_load_weights raises 'attribute already exists'",
        how="AROUND: drop the previous plain attribute, run the original, then move _bfa_f_b_w out of "
            "_parameters into a plain (unregistered) attribute",
        upstream=PR_37704 + " item 5",
        remove_when="_merge_bfa_weights stores the alias without registering it",
    ),
    # ------------------------------------------------------------------ MoE LoRA on MXFP4 + SiTU
    HookSpec(
        name="moe_lora_mxfp4_quant_info",
        target="sglang.srt.lora.layers.FusedMoEWithLoRA.__init__",
        kind="around", fn="kimi_sglang_plugin.moe_lora:fused_moe_with_lora_init",
        why="with --moe-runner-backend marlin, FusedMoEWithLoRA asserts the quant method is "
            "CompressedTensorsFusedMoEMethod/ModelOptNvFp4FusedMoEMethod and calls get_marlin_quant_info, "
            "which Mxfp4MoEMethod lacks (PR #27930 closed); it also treats SiTU's gemm1_alpha as "
            "GPT-OSS interleaved gate/up",
        how="AROUND: for an Mxfp4MoEMethod layer, present a quant-info adapter during the stock __init__ "
            "(moe_lora.Mxfp4MarlinQuantInfoAdapter), restore the real quant method, clear the interleave flag "
            "for SiTU; the marlin LoRA runner core (moe_lora.register_runner_core) runs SiTU",
        upstream="sgl-project/sglang#27930 (closed), " + PR_37704,
        remove_when="Mxfp4MoEMethod exposes get_marlin_quant_info and MarlinLoraRunnerCore supports situ",
    ),
)


def resolve_target(target: str):
    """Import and return the object at dotted ``target`` (as ``HookRegistry`` will)."""
    obj_path, attr = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), attr)


def resolve_hook(spec: HookSpec):
    mod, fn = spec.fn.split(":")
    return getattr(importlib.import_module(mod), fn)


def check_targets(version: str, hooks: tuple[HookSpec, ...] | None = None) -> list[str]:
    """``["<hook name>: <problem>", ...]`` for every ledger entry whose target or hook does not resolve
    (or whose checked releases do not include ``version``); empty when all is well."""
    problems = []
    for spec in HOOKS if hooks is None else hooks:
        if version not in spec.versions:
            problems.append(f"{spec.name}: checked only against SGLang {spec.versions}, not {version}")
            continue
        try:
            resolve_target(spec.target)
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"{spec.name}: target {spec.target} not found ({type(e).__name__}: {e})")
        try:
            resolve_hook(spec)
        except (ImportError, AttributeError) as e:
            problems.append(f"{spec.name}: hook {spec.fn} not importable ({e})")
    return problems
