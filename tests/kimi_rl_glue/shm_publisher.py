"""Child-process side of ``test_shm_sync``: publish a deterministic adapter through shared memory."""

from __future__ import annotations


def make_adapter(seed: int):
    from kimi_core.config import KimiConfig
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.lora import LoraSpec, random_adapter
    import torch

    cfg = KimiConfig.from_hf(tiny_config("k2", layers=2))
    return random_adapter(cfg, LoraSpec(rank=8, exclude_modules=("kv_b_proj",)), seed=seed, dtype=torch.bfloat16)


def publish(channel: str, version: int, seed: int, bucket_bytes: int) -> None:
    from kimi_rl_glue.sync import ShmAdapterSync

    ShmAdapterSync(channel, bucket_bytes).publish(make_adapter(seed), version)
