"""Kimi K3.1 (``KimiK31ForConditionalGeneration``): K3 plus the DSA lightning indexer on its MLA layers.

Status: **registered, not servable yet.** vLLM has no K3.1; its in-tree K3 MLA has no indexer
slot, and the plugin's indexer-on-K3-MLA layer is not written. Building this class raises
:class:`NotImplementedError` naming what is missing instead of silently serving K3 without the
indexer (which would give wrong attention for contexts longer than ``index_topk``).
The LoRA interface (all ``SupportsLoRA`` members, ``get_expert_mapping``) is in place.
"""

from __future__ import annotations

from kimi_vllm_plugin.models.kimi_k3 import KimiK3LoRAForConditionalGeneration

__all__ = ["KimiK31ForConditionalGeneration"]


class KimiK31ForConditionalGeneration(KimiK3LoRAForConditionalGeneration):
    """K3.1 (not servable yet; see the module docstring)."""

    def __init__(self, vllm_config, prefix: str = ""):
        text = getattr(vllm_config.model_config.hf_config, "text_config", None)
        topk = getattr(text, "index_topk", None)
        raise NotImplementedError(
            f"kimi_vllm_plugin: KimiK31ForConditionalGeneration (index_topk={topk}) needs the DSA lightning "
            "indexer on K3's MLA layers, which this plugin version does not implement; serving it as K3 would "
            "drop the sparse-attention mask. Track: docs/vllm.md 'K3.1'.")
