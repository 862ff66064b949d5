"""Trainer-side LoRA for the Kimi Megatron models.

* :mod:`.layers` - :class:`LoraLinear` (column / row / replicated TP maths) for megatron linears;
* :mod:`.experts` - :class:`LoraExperts` on the W4A16 grouped experts (per-expert, shared-outer,
  capacity-normalised rank);
* :mod:`.apply` - :func:`apply_lora` (targets by the spec's lists) and :class:`KimiLora`;
* :mod:`.attach` - :func:`attach_lora`: the factors as a hidden child of a host's model chunk (miles, SkyRL);
* :mod:`.export` - HF/PEFT export in every engine layout and checked bucket streaming;
* :mod:`.checkpoint` - per-rank adapter + optimizer shards, save / resume.

Naming, layouts, validation and buckets are :mod:`kimi_core.lora`'s; nothing is duplicated here.
"""

from kimi_megatron_plugin.lora.apply import KimiLora, LoraApplyError, apply_lora
from kimi_megatron_plugin.lora.attach import SLOT, attach_lora, lora_of
from kimi_megatron_plugin.lora.experts import LoraExperts
from kimi_megatron_plugin.lora.export import export_adapter, iter_export_buckets, lora_decomposed
from kimi_megatron_plugin.lora.layers import LoraLinear

__all__ = [
    "KimiLora",
    "LoraApplyError",
    "LoraExperts",
    "LoraLinear",
    "SLOT",
    "apply_lora",
    "attach_lora",
    "lora_of",
    "export_adapter",
    "iter_export_buckets",
    "lora_decomposed",
]
