"""The ``SupportsLoRA`` members every Kimi class of the plugin carries, in one place.

vLLM's worker gates LoRA with an instance-level runtime ``Protocol`` check, so **every** member
must exist (NovaSky-AI/SkyRL#2027): ``supports_lora``, ``is_3d_moe_weight``, ``is_non_gated_moe``,
``embedding_modules``, ``packed_modules_mapping``, ``lora_skip_prefixes``; MoE LoRA also needs
``get_expert_mapping()`` (``vllm/lora/utils.py`` ``process_packed_modules_mapping``).
"""

from __future__ import annotations

from kimi_vllm_plugin.mapping import expert_lora_names, expert_mapping

__all__ = ["LORA_MEMBERS", "KimiLoRAMixin"]

#: the class attributes vLLM's SupportsLoRA protocol reads (plus get_expert_mapping)
LORA_MEMBERS = (
    "supports_lora",
    "is_3d_moe_weight",
    "is_non_gated_moe",
    "embedding_modules",
    "packed_modules_mapping",
    "lora_skip_prefixes",
    "get_expert_mapping",
)


class KimiLoRAMixin:
    """Mixin for the multimodal wrappers (K2.5, K3, K3.1): LoRA members delegating to the text model.

    ``_expert_names`` is ``(gate, down, up)`` of the family's HF expert projections.
    """

    supports_lora = True
    is_3d_moe_weight = False
    is_non_gated_moe = False
    embedding_modules: dict[str, str] = {}
    lora_skip_prefixes: list[str] = ["mtp.", "language_model.mtp."]
    # the wrappers are not nominal SupportsLoRA subclasses, so the worker's isinstance check is
    # structural and also wants this (set by vLLM's LoRA manager; seen: "does not support LoRA yet")
    lora_manager = None
    _expert_names = ("gate_proj", "down_proj", "up_proj")

    def _text_config(self):
        cfg = self.config
        return getattr(cfg, "text_config", cfg)

    def _num_routed_experts(self) -> int:
        t = self._text_config()
        return int(getattr(t, "n_routed_experts", None) or t.num_experts)

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        """``(param prefix, checkpoint prefix, expert, shard)``, w1/w2/w3 per expert."""
        return expert_mapping(self._num_routed_experts(), *self._expert_names)

    def _add_expert_lora_names(self) -> None:
        self.packed_modules_mapping["experts"] = expert_lora_names(self._num_routed_experts(), *self._expert_names)
