"""The ledger of every patch this plugin applies to SGLang, one :class:`HookPatch` row per patch and release
range, applied through SGLang's own ``HookRegistry``.

Each row is a :class:`kimi_core.patch_ledger.PatchEntry` (target, ``versions``, Why, How, the upstream issue or
PR, the condition to remove it) plus what ``HookRegistry`` needs: the hook type and our hook function. Where a
fix needs different code per release the ledger has one row per variant (same ``name``, disjoint
``versions``); where a bug is absent in a supported release the row's ``versions`` leave it out and
``absent_in`` says why. The code of each patch is one module of this package, whose docstring explains the
mechanism:

* :mod:`.k31_dsa_gates`: SGLang sees K3.1 as K3 + DSA (config gate, index head dim, model class);
* the five K3 LoRA fixes of sgl-project/sglang#37704 ("Kimi K3 colocated RL: LoRA fixes and in-place MXFP4
  Marlin reload", open against ``sglang-miles``): :mod:`.lora_shared_experts_alias`, :mod:`.lora_output_gate`,
  :mod:`.lora_latent_expert_width`, :mod:`.lora_params_dtype`, :mod:`.kda_f_b_proj_alias`;
* :mod:`.moe_lora_marlin`: MoE LoRA on MXFP4 + SiTU experts (the pieces are in :mod:`kimi_sglang_plugin.moe_lora`);
* :mod:`.attn_residual_width`, :mod:`.routed_experts_capture`, :mod:`.lora_unfused_front`,
  :mod:`.hybrid_indexer_metadata`, :mod:`.checksum_refusal`.

What each supported release has at each target is recorded data (:data:`kimi_sglang_plugin.host_support.FACTS`).
:func:`check_hook_patch` is :func:`kimi_core.patch_ledger.check_patch` plus that record: a target missing,
changed, or without a row for the running release raises :class:`~kimi_core.errors.PatchTargetError` naming
the row, before anything is patched.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry, check_patch
from kimi_sglang_plugin.host_support import FACTS, SUPPORTED_SGLANG, compare

__all__ = [
    "HookPatch",
    "LEDGER",
    "HOST",
    "covered_releases",
    "patches_for",
    "resolve_hook",
    "check_hook_patch",
    "patch_problems",
]

#: the distribution whose release a row's ``versions`` constrains
HOST = "sglang"
#: ``versions`` of a row for both supported releases (the ones between are refused by host_support first)
BOTH = ">=0.5.17,<=0.5.23"
ONLY_0517 = "==0.5.17"
ONLY_0523 = "==0.5.23"
PR_37704 = "sgl-project/sglang#37704"


@dataclass(frozen=True)
class HookPatch(PatchEntry):
    """A ledger row applied through ``HookRegistry``.

    :param hook: the ``HookType`` value: ``"before"``, ``"after"``, ``"around"`` or ``"replace"``.
    :param fn: ``"module:function"`` of our hook.
    :param absent_in: why the patch does not apply to the supported releases its ``versions`` leave out.
    """

    hook: str = "around"
    fn: str = ""
    absent_in: str = ""

    @property
    def key(self) -> str:
        """``name@release+release``: unique across the ledger."""
        return f"{self.name}@{'+'.join(covered_releases(self))}"

    def hook_type(self):
        """SGLang's ``HookType`` of :attr:`hook`."""
        from sglang.srt.plugins.hook_registry import HookType

        return HookType(self.hook)


def covered_releases(entry: PatchEntry) -> tuple[str, ...]:
    """The supported SGLang releases inside ``entry.versions``."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(entry.versions)
    return tuple(r for r in SUPPORTED_SGLANG if r in spec)


_M = "sglang.srt.models.kimi_k3."
_GATE_WHY = (
    "K3's MLA output gate (x * sigmoid(g_proj(h))) is applied by replacing o_proj.forward on the "
    "instance; RowParallelLinearWithLoRA calls base_layer.quant_method.apply directly, so with LoRA on "
    "o_proj the gate is silently dropped"
)

LEDGER: tuple[HookPatch, ...] = (
    # ------------------------------------------------------------------ K3.1 / DSA gates
    HookPatch(
        name="k31_is_deepseek_dsa",
        target="sglang.srt.configs.model_config.is_deepseek_dsa",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.k31_dsa_gates:is_deepseek_dsa",
        why="is_deepseek_dsa keys DSA on a fixed architecture list without K3/K3.1; it selects the "
        "indexer in DeepseekV2AttentionMLA, the DSA KV/index pool and the DSA attention backends",
        how="AROUND: true when the original is, or when the config is K3.1 (K3.1 in architectures and "
        "index_topk set, kimi_k31_config.is_k31_config); _propagate_patch rebinds the 'from ... import' sites",
        upstream="none (no K3.1 in sglang 0.5.17, 0.5.23 or sglang-miles)",
        remove_when="SGLang lists KimiK31ForConditionalGeneration in is_deepseek_dsa",
        versions=BOTH,
    ),
    HookPatch(
        name="k31_index_head_dim",
        target="sglang.srt.configs.model_config.ModelConfig._derive_model_shapes",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.k31_dsa_gates:derive_index_head_dim",
        why="the K3 branch of _derive_model_shapes sets MLA shapes but never index_head_dim, which the "
        "DSA index-K pool (pool_configurator) is sized by",
        how="AFTER: for a K3.1 config set model_config.index_head_dim = text_config.index_head_dim",
        upstream="none",
        remove_when="SGLang derives index_head_dim for K3-family DSA configs",
        versions=BOTH,
    ),
    HookPatch(
        name="k31_resolve_model_cls",
        target="sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.k31_dsa_gates:resolve_model_cls",
        why="a K3.1 config reads as K3 to every arch gate (kimi_k31_config.KimiK31Config), so the registry's "
        "first-arch path would build the stock K3 class",
        how="AROUND: when KimiK31ForConditionalGeneration is in the architectures list, return our "
        "class from ModelRegistry.models (resolved arch name K3.1)",
        upstream="none",
        remove_when="K3.1 is in-tree, or SGLang resolves by model_type",
        versions=BOTH,
    ),
    # ------------------------------------------------------------------ sgl-project/sglang#37704
    HookPatch(
        name="37704_1_num_shared_experts",
        target="sglang.srt.configs.kimi_linear.KimiLinearConfig.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.lora_shared_experts_alias:alias_num_shared_experts",
        why="LoRA sizing reads only n_shared_experts (lora/utils.get_hidden_dim's defaults, "
        "lora/mem_pool._get_num_shared_experts, lora/lora.py); K3 configs say num_shared_experts, so "
        "shared-expert gate_up/down LoRA buffers get the dense MLP width",
        how="AFTER on the config constructor: set n_shared_experts = num_shared_experts when absent "
        "(one alias fixes every reader; K3 model code reads num_shared_experts only)",
        upstream=PR_37704 + " item 1",
        remove_when="SGLang LoRA reads num_shared_experts (or the PR lands in a release we pin)",
        versions=BOTH,
    ),
    HookPatch(
        name="37704_2_output_gate_lora_o_proj",
        target=_M + "KimiK3MLAAttention.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.lora_output_gate:install_o_proj_input_transform",
        why=_GATE_WHY,
        how="AFTER: attach the gate as o_proj._kimi_lora_input_transform, computed as 0.5.23 does "
        "(_compute_output_gate, joining _gate_pending_stream when skipped); the row-parallel hook "
        "applies it inside the LoRA wrapper",
        upstream=PR_37704 + " item 2 (lora_input_transform)",
        remove_when="RowParallelLinearWithLoRA honours a base-layer input transform upstream",
        versions=ONLY_0523,
    ),
    HookPatch(
        name="37704_2_output_gate_lora_o_proj",
        target=_M + "KimiK3MLAAttention.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.lora_output_gate:install_o_proj_precomputed_gate",
        why=_GATE_WHY + " (0.5.17: same bug; its gate comes from _gate_precomputed or g_proj)",
        how="AFTER: attach the gate as o_proj._kimi_lora_input_transform, computed as 0.5.17 does "
        "(the alt-stream gate in _gate_precomputed, joined first, else g_proj(h))",
        upstream=PR_37704 + " item 2",
        remove_when="as the 0.5.23 entry",
        versions=ONLY_0517,
    ),
    HookPatch(
        name="37704_2_row_parallel_lora_forward",
        target="sglang.srt.lora.layers.RowParallelLinearWithLoRA.forward",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.lora_output_gate:row_parallel_lora_forward",
        why="see 37704_2_output_gate_lora_o_proj",
        how="AROUND: input_ = base_layer._kimi_lora_input_transform(input_) when present, so base GEMM "
        "and LoRA A both see the gated input (as without LoRA)",
        upstream=PR_37704 + " item 2",
        remove_when="as 37704_2_output_gate_lora_o_proj",
        versions=BOTH,
    ),
    HookPatch(
        name="37704_3_routed_expert_hidden_size",
        target="sglang.srt.lora.utils.get_hidden_dim",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.lora_latent_expert_width:latent_moe_hidden_dim",
        why="routed-expert LoRA buffers (gate_up_proj_moe, down_proj_moe) are sized with hidden_size; "
        "K3's latent MoE experts read and write routed_expert_hidden_size (3584 vs 7168)",
        how="AROUND get_hidden_dim (what the LoRA memory pool calls in both releases; 0.5.23 moved its "
        "config defaults into get_default_hidden_dim): for those two modules use "
        "routed_expert_hidden_size when the config has one",
        upstream=PR_37704 + " item 3",
        remove_when="SGLang LoRA sizes MoE buffers from the experts' own width",
        versions=BOTH,
    ),
    HookPatch(
        name="37704_4_params_dtype_through_wrapper",
        target="sglang.srt.lora.layers.BaseLayerWithLoRA.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.lora_params_dtype:mirror_params_dtype",
        why="KimiK3LinearForCausalLM.post_load_weights reads self_attn.o_proj.params_dtype to "
        "precompile the KDA kernel; through a LoRA wrapper it is None and falls back to the "
        "(possibly quantized) weight dtype on every RL reload",
        how="AFTER: mirror base_layer.params_dtype onto the wrapper, as it already mirrors weight/bias",
        upstream=PR_37704 + " item 4",
        remove_when="BaseLayerWithLoRA forwards params_dtype upstream",
        versions=ONLY_0523,
        absent_in="0.5.17: post_load_weights reads o_proj.weight.dtype (models/kimi_k3.py:2926), which "
        "the wrapper mirrors",
    ),
    HookPatch(
        name="37704_5_f_b_proj_registered_twice",
        target=_M + "KimiK3DeltaAttention._merge_bfa_weights",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.kda_f_b_proj_alias:merge_bfa_weights_once",
        why="`self._bfa_f_b_w = self.f_b_proj.weight` registers the Parameter a second time; "
        "named_parameters() then yields it as self_attn._bfa_f_b_w before self_attn.f_b_proj.weight, "
        "whose name disappears from params_dict, so RL weight reloads skip f_b_proj silently, and "
        "the second post_load_weights raises 'attribute already exists'",
        how="AROUND: drop the previous plain attribute, run the original, then move _bfa_f_b_w out of "
        "_parameters into a plain (unregistered) attribute",
        upstream=PR_37704 + " item 5",
        remove_when="_merge_bfa_weights stores the alias without registering it",
        versions=ONLY_0523,
        absent_in="0.5.17: _merge_bfa_weights (models/kimi_k3.py:1525) merges only f_a_proj + b_proj into "
        "a plain tensor and never aliases f_b_proj",
    ),
    # ------------------------------------------------------------------ MoE LoRA on MXFP4 + SiTU
    HookPatch(
        name="moe_lora_mxfp4_quant_info",
        target="sglang.srt.lora.layers.FusedMoEWithLoRA.__init__",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.moe_lora_marlin:fused_moe_with_lora_init",
        why="with --moe-runner-backend marlin, FusedMoEWithLoRA asserts the quant method is "
        "CompressedTensorsFusedMoEMethod/ModelOptNvFp4FusedMoEMethod and calls get_marlin_quant_info, "
        "which Mxfp4MoEMethod lacks (PR #27930 closed); it also treats SiTU's gemm1_alpha as "
        "GPT-OSS interleaved gate/up",
        how="AROUND: for an Mxfp4MoEMethod layer, present a quant-info adapter during the stock __init__ "
        "(kimi_sglang_plugin.moe_lora.Mxfp4MarlinQuantInfoAdapter), restore the real quant method, clear the "
        "interleave flag for SiTU",
        upstream="sgl-project/sglang#27930 (closed), " + PR_37704,
        remove_when="Mxfp4MoEMethod exposes get_marlin_quant_info",
        versions=BOTH,
    ),
    HookPatch(
        name="moe_lora_situ_stage",
        target="sglang.srt.lora.lora_moe_runner_marlin.MarlinLoraRunnerCore.run_from_dispatch",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.moe_lora_marlin:marlin_lora_run_from_dispatch",
        why="MarlinLoraRunnerCore asserts activation == 'silu'; K3's experts are SiTU. 0.5.23 could take a "
        "registered runner core (register_moe_runner_core), but 0.5.17 has no registration point "
        "(moe_runner/runner.py:77 builds MarlinLoraRunnerCore directly), so one hook on the core's "
        "entry serves both",
        how="AROUND: SiLU layers pass through unchanged; a SiTU layer runs the stock core with its "
        "module-level silu_and_mul bound to SiTU (beta=gemm1_alpha, linear_beta=gemm1_clamp_limit) for "
        "that call and activation presented as silu; Marlin GEMMs, alignment, EP masks and LoRA hooks "
        "stay the stock core's",
        upstream="none (no SiTU in the Marlin LoRA core upstream)",
        remove_when="MarlinLoraRunnerCore supports activation 'situ'",
        versions=BOTH,
    ),
    HookPatch(
        name="moe_lora_cuda_graph_buffers",
        target="sglang.srt.lora.backend.base_backend.BaseLoRABackend.init_cuda_graph_moe_buffers",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.moe_lora_marlin:init_cuda_graph_moe_buffers",
        why="0.5.17 sizes the shared MoE LoRA CUDA-graph buffers from quant_info.w13_weight / w2_weight "
        "(lora/backend/base_backend.py:222); a Marlin quant info has w13_qweight / w2_qweight only, so "
        "Marlin MoE LoRA with CUDA graphs raises AttributeError at startup",
        how="AROUND: for a Marlin quant info, run the original on a view of the layer whose quant info "
        "exposes shape-only w13_weight [E, 2I, K] / w2_weight [E, K, I] (from the FusedMoE's own sizes) "
        "on the device of w13_qweight",
        upstream="fixed in 0.5.23 (reads w13_qweight, lora/backend/base_backend.py:306)",
        remove_when="0.5.17 is no longer supported",
        versions=ONLY_0517,
        absent_in="0.5.23: the buffers no longer depend on the weight shapes",
    ),
    # ------------------------------------------------------------------ K3 at other widths
    HookPatch(
        name="attn_residual_any_width",
        target="sglang.srt.layers.attn_residual._mix_fused",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.attn_residual_width:mix_any_width",
        why="the attention-residual Triton kernels cover hidden_size // 1024 blocks with no mask or remainder "
        "(_BLOCK_H = 1024): at other widths the mixture is left uninitialised and K3 is served wrong "
        "without an error (at hidden 512 the served logprobs are uncorrelated with the reference)",
        how="AROUND: hidden_size % 1024 != 0 returns SGLang's own eager aggregate_stream_torch (what its "
        "aggregate_stream already falls back to for those widths); multiples of 1024 keep the kernels",
        upstream="not filed yet",
        remove_when="_mix_fused masks its column blocks or falls back itself",
        versions=BOTH,
    ),
    # ------------------------------------------------------------------ routed experts (routing replay)
    HookPatch(
        name="k3_routed_experts_top_k_name",
        target="sglang.srt.configs.kimi_linear.KimiLinearConfig.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.routed_experts_capture:alias_num_experts_per_tok",
        why="RoutedExpertsCapturer reads hf_text_config.num_experts_per_tok, which K3's KimiLinearConfig calls "
        "num_experts_per_token: with --enable-return-routed-experts the scheduler dies at memory pool init "
        "(stock K3 too)",
        how="AFTER: set config.num_experts_per_tok = config.num_experts_per_token",
        upstream="fixed in 0.5.23 (KimiLinearConfig.attribute_map)",
        remove_when="0.5.17 leaves the supported releases",
        versions=ONLY_0517,
        absent_in="0.5.23: KimiLinearConfig.attribute_map maps num_experts_per_tok (configs/kimi_linear.py:13)",
    ),
    HookPatch(
        name="k3_routed_experts_topk_layer_id",
        target=_M + "KimiK3MoE.__init__",
        host=HOST,
        hook="after",
        fn="kimi_sglang_plugin.patches.routed_experts_capture:topk_layer_id",
        why="KimiK3MoE builds TopK without layer_id, so the routed-experts capture indexes its buffer with None "
        "and the first prefill raises a shape error (stock K3 too)",
        how="AFTER: moe.topk.layer_id = moe.layer_idx when it is None",
        upstream="fixed in 0.5.23 (TopK(layer_id=self.layer_idx), models/kimi_k3.py:524)",
        remove_when="0.5.17 leaves the supported releases",
        versions=ONLY_0517,
        absent_in="0.5.23: KimiK3MoE passes layer_id=self.layer_idx to TopK (models/kimi_k3.py:526)",
    ),
    HookPatch(
        name="k3_lora_unfused_moe_front",
        target=_M + "KimiK3MoE._merge_front_weights",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.lora_unfused_front:merge_front_weights_unless_lora",
        why="the merged MoE front multiplies by one buffer holding shared_experts.gate_up_proj, gate and "
        "routed_expert_down_proj, and the shared down GEMM reads down_proj.weight directly; LoRA wraps those "
        "modules after the merge, so shared-expert LoRA is loaded and silently not applied (served logprobs "
        "far outside the bf16 floor)",
        how="AROUND: skip the merge when the server has LoRA on (or its arguments cannot be read), so every "
        "forward takes _forward_unfused, which calls the LoRA-wrapped modules",
        upstream="none (0.5.17 and 0.5.23 both merge)",
        remove_when="SGLang skips or LoRA-aware-fuses the K3 MoE front when LoRA is enabled",
        versions=BOTH,
    ),
    HookPatch(
        name="k31_hybrid_indexer_metadata",
        target="sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.get_indexer_metadata",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.hybrid_indexer_metadata:indexer_metadata_from_full_backend",
        why="K3's hybrid KDA + MLA backend inherits get_indexer_metadata -> None on 0.5.17, so K3.1's DSA indexer "
        "returns no top-k and flashmla_sparse prefill raises on None",
        how="AROUND: for a full-attention layer with no metadata, return full_attn_backend.get_indexer_metadata",
        upstream="fixed in 0.5.23 (layers/attention/hybrid_linear_attn_backend.py:1315)",
        remove_when="0.5.17 leaves the supported releases",
        versions=ONLY_0517,
        absent_in="0.5.23: HybridLinearAttnBackend forwards get_indexer_metadata to its full-attention backend",
    ),
    # ------------------------------------------------------------------ adapter sync
    HookPatch(
        name="lora_check_mismatch_refused",
        target="sglang.srt.managers.tp_worker.BaseTpWorker.load_lora_adapter_from_tensors",
        host=HOST,
        hook="around",
        fn="kimi_sglang_plugin.patches.checksum_refusal:refuse_checksum_mismatch",
        why="with expected_checksums, a tensor whose sha256 differs raises RuntimeError('[LORA-CHECK] ... "
        "MISMATCH') out of the worker, which nothing catches: the scheduler exits and the engine goes "
        "down on one flipped byte, instead of refusing one version",
        how="AROUND: that RuntimeError becomes LoRAManager.create_lora_update_result(success=False, message), "
        "the result of any other bad adapter; the tokenizer manager does not register it and the last "
        "good adapter keeps serving. Other errors propagate unchanged",
        upstream="not filed yet",
        remove_when="load_lora_adapter_from_tensors returns a failed LoRAUpdateOutput on a checksum mismatch",
        versions=BOTH,
    ),
)


def patches_for(release: str) -> tuple[HookPatch, ...]:
    """The ledger rows whose ``versions`` contain SGLang ``release``."""
    from packaging.specifiers import SpecifierSet

    return tuple(e for e in LEDGER if release in SpecifierSet(e.versions))


def resolve_hook(entry: HookPatch):
    """Our hook function of ``entry`` (imports its module)."""
    mod, fn = entry.fn.split(":")
    return getattr(importlib.import_module(mod), fn)


def check_hook_patch(entry: HookPatch, release: str) -> None:
    """:func:`kimi_core.patch_ledger.check_patch` for SGLang ``release``, plus the target against the recorded
    facts of that release and the import of our hook function; nothing is patched.

    :raises PatchTargetError: naming the row, the target and what differs (with where the release has it).
    """
    if release not in FACTS.get(entry.target, {}):
        raise PatchTargetError(
            f"{entry.key}: target {entry.target} has no recorded facts for SGLang {release} "
            "(kimi_sglang_plugin/host_support.py)"
        )
    differs = compare(entry.target, release)
    if differs is not None:
        raise PatchTargetError(f"{entry.key}: {differs}")
    check_patch(entry, release)
    try:
        resolve_hook(entry)
    except (ImportError, AttributeError) as e:
        raise PatchTargetError(f"{entry.key}: hook {entry.fn} not importable ({e})") from e


def patch_problems(release: str, entries: tuple[HookPatch, ...] | None = None) -> list[str]:
    """The :func:`check_hook_patch` message of every row of ``entries`` (default: the ledger) that applies to
    SGLang ``release`` and does not pass; empty when all is well."""
    from packaging.specifiers import SpecifierSet

    problems = []
    for entry in LEDGER if entries is None else entries:
        if release not in SpecifierSet(entry.versions):
            continue
        try:
            check_hook_patch(entry, release)
        except PatchTargetError as e:
            problems.append(str(e))
    return problems
