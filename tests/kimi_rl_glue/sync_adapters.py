"""A deterministic tiny adapter for the sync tests."""

from __future__ import annotations


def make_adapter(seed: int):
    import torch

    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.config import KimiConfig
    from kimi_core.lora import LoraSpec, random_adapter

    cfg = KimiConfig.from_hf(tiny_config("k2", layers=2))
    return random_adapter(cfg, LoraSpec(rank=8, exclude_modules=("kv_b_proj",)), seed=seed, dtype=torch.bfloat16)
