"""Kimi K3.1 (``KimiK31ForConditionalGeneration``, ``model_type: kimi_k31``): K3 plus the DSA lightning
indexer on each MLA layer (``self_attn.indexer``,
:class:`~kimi_vllm_plugin.models.kimi_k31_indexer.KimiK31Indexer`).

What is built: K3 (:class:`~kimi_vllm_plugin.models.kimi_k3.KimiK3LoRAForConditionalGeneration`)
with an indexer module on every MLA layer, so the checkpoint's ``indexer.*`` tensors load into
parameters and adapters can name them. What is **not** written: the sparse MLA that uses the
indexer's top-k (vLLM's K3 MLA has no slot for it). A query at position p sees p+1 keys, and for
p+1 <= ``index_topk`` the top-k keeps all of them, so dense MLA is exact there. Construction
therefore requires ``max_model_len <= index_topk`` (2048 tokens for the [I] K3.1 config) and
refuses longer contexts with an error naming the flag, instead of silently serving K3 attention.

Registered for vLLM 0.27 - 0.33 only: vLLM 0.34 serves K3.1 itself (its K3 class with DSA sparse attention, the
indexer read from ``text_config.dsa_config`` into ``self_attn.dsa_indexer``), which this class would shadow and
whose config it cannot read (``kimi_vllm_plugin.host_support.SUPPORT``; ``docs/vllm.md``).
"""

from __future__ import annotations

from kimi_core.architectures import K31
from kimi_vllm_plugin.models.kimi_k3 import KimiK3LoRAForConditionalGeneration

__all__ = ["KimiK31ForConditionalGeneration", "check_context_fits_topk"]


def check_context_fits_topk(vllm_config) -> int:
    """Raise ``NotImplementedError`` unless ``max_model_len <= index_topk``; returns ``index_topk``."""
    text = vllm_config.model_config.hf_config.text_config
    topk = getattr(text, "index_topk", None)
    if not topk:
        raise ValueError(
            f"config.json text_config.index_topk is missing: not a K3.1 checkpoint "
            f"(architectures=['{K31}'] needs index_topk/index_n_heads/index_head_dim)"
        )
    max_len = vllm_config.model_config.max_model_len
    if max_len > topk:
        raise NotImplementedError(
            f"kimi_vllm_plugin: K3.1 with --max-model-len {max_len} > text_config.index_topk {topk} needs the "
            "DSA sparse attention, which this plugin does not implement; serve with --max-model-len "
            f"{topk} or less (then every visible key is in the top-k and dense MLA is exact)"
        )
    return int(topk)


class KimiK31ForConditionalGeneration(KimiK3LoRAForConditionalGeneration):
    """K3.1: K3 with ``self_attn.indexer`` on every MLA layer (contexts up to ``index_topk``)."""

    def __init__(self, vllm_config, prefix: str = ""):
        from kimi_vllm_plugin.models.kimi_k31_indexer import KimiK31Indexer

        self.index_topk = check_context_fits_topk(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        text = self.config.text_config
        model = self.language_model.model
        for i in range(model.start_layer, model.end_layer):
            if not text.is_kda_layer(i):
                attn = model.layers[i].self_attn
                attn.indexer = KimiK31Indexer(text, prefix=f"{attn_prefix(prefix, i)}.indexer")

    def mla_layers(self) -> list[int]:
        """0-based indices of the layers that carry an indexer (the MLA layers)."""
        m = self.language_model.model
        return [i for i in range(m.start_layer, m.end_layer) if hasattr(m.layers[i].self_attn, "indexer")]


def attn_prefix(prefix: str, layer: int) -> str:
    """vLLM module name of layer ``layer``'s attention (``language_model.model.layers.{l}.self_attn``)."""
    return f"{prefix + '.' if prefix else ''}language_model.model.layers.{layer}.self_attn"
