"""Patch ``lora_layers``: let vLLM's LoRA manager wrap our CPU routed experts (ledger in ``__init__``)."""

from __future__ import annotations

import logging

__all__ = ["apply_lora_layers", "TESTED_VLLM"]

logger = logging.getLogger(__name__)
TESTED_VLLM = ("0.32.", "0.33.")


def apply_lora_layers() -> bool:
    """Prepend ``KimiCpuExpertsWithLoRA`` to ``vllm.lora.utils._all_lora_classes``; idempotent.

    Returns True if the tuple now holds the wrapper. Raises ``RuntimeError`` naming the symbol if
    the installed vLLM no longer has it (the patch must then be revisited).
    """
    import vllm
    import vllm.lora.utils as lu

    from kimi_vllm_plugin.moe_lora_cpu import lora_layer_class

    if not vllm.__version__.startswith(TESTED_VLLM):
        logger.warning("kimi_vllm_plugin: patch lora_layers is untested on vLLM %s", vllm.__version__)
    classes = getattr(lu, "_all_lora_classes", None)
    if not isinstance(classes, tuple):
        raise RuntimeError(f"kimi_vllm_plugin: vllm.lora.utils._all_lora_classes missing in vLLM {vllm.__version__}; "
                           "the CPU MoE LoRA patch (kimi_vllm_plugin/patches/lora_layers.py) needs updating")
    cls = lora_layer_class()
    if cls not in classes:
        lu._all_lora_classes = (cls, *classes)
    return True
