"""Framework-free LoRA adapters of the Kimi models: spec and PEFT config, HF/PEFT names, expert
layouts and conversions, validated loading into per-module factors, and size accounting (bucketed
streaming with checksums: :mod:`kimi_core.sync`). Used by ``kimi_core.reference``, the engine plugins and the trainer.
"""

from kimi_core.lora.adapter import Adapter, AdapterError
from kimi_core.lora.config import ALL_LINEAR, AdapterConfigError, LoraSpec, read_adapter_config, write_adapter_config
from kimi_core.lora.layouts import convert_layout
from kimi_core.lora.naming import iter_targets, target_shapes
from kimi_core.lora.random_adapter import random_adapter
from kimi_core.lora.resolve import ExpertStack, LoraFactors, ResolvedAdapter, load_adapter
from kimi_core.lora.sizes import adapter_nbytes

__all__ = [
    "ALL_LINEAR",
    "Adapter",
    "AdapterConfigError",
    "AdapterError",
    "ExpertStack",
    "LoraFactors",
    "LoraSpec",
    "ResolvedAdapter",
    "adapter_nbytes",
    "convert_layout",
    "iter_targets",
    "load_adapter",
    "random_adapter",
    "read_adapter_config",
    "target_shapes",
    "write_adapter_config",
]
