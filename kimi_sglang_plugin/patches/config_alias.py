"""K3 config fields under the DeepSeek names SGLang reads: K3's ``KimiLinearConfig`` says ``num_shared_experts`` /
``num_experts_per_token`` where SGLang's LoRA sizing and routed-experts capturer read ``n_shared_experts`` /
``num_experts_per_tok`` (shared by :mod:`.lora_shared_experts_alias` and :mod:`.routed_experts_capture`)."""

from __future__ import annotations


def alias_field(config, k3_name: str, deepseek_name: str) -> None:
    """``config.<deepseek_name> = config.<k3_name>`` when the K3 field is set and the DeepSeek one is not."""
    value = getattr(config, k3_name, None)
    if value is not None and getattr(config, deepseek_name, None) is None:
        setattr(config, deepseek_name, value)
