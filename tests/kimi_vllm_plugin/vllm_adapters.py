"""Adapters the engine tests load: two good versions (per-expert and shared-outer, capacity-normalised
expert ranks via ``rank_pattern``) and one bad adapter per rejection reason."""

from __future__ import annotations

import os

import torch

from kimi_core.lora import LoraSpec, random_adapter

#: engine max_lora_rank; dense rank 16, experts 16 // top_k(4) = 4 through rank_pattern
MAX_LORA_RANK = 16


def spec(layout: str) -> LoraSpec:
    # kv_b_proj is absorbed into vLLM's MLA kernel (see kimi_vllm_plugin/models/deepseek_v3.py)
    return LoraSpec(rank=16, alpha=32.0, target_modules="all-linear", exclude_modules=("kv_b_proj",),
                    expert_layout=layout, normalize_moe_lora=True)


def write_all(config, root: str) -> dict[str, str]:
    """Write every adapter under ``root``; returns ``{tag: path}`` (``missing`` does not exist)."""
    out = {}
    a = random_adapter(config, spec("per_expert"), seed=1, b_std=0.3)
    out["A"] = a.save(os.path.join(root, "A"))
    b = random_adapter(config, spec("shared_outer"), seed=2, b_std=0.3)
    out["B"] = b.save(os.path.join(root, "B"))
    big = random_adapter(config, LoraSpec(rank=32, alpha=32.0, exclude_modules=("kv_b_proj",)), seed=3)
    out["rank32"] = big.save(os.path.join(root, "rank32"))
    unk = a.copy()
    name = next(iter(unk.tensors))
    unk.tensors["base_model.model.model.layers.1.mlp.foo_proj.lora_A.weight"] = unk.tensors[name].clone()
    unk.tensors["base_model.model.model.layers.1.mlp.foo_proj.lora_B.weight"] = torch.zeros(4, 16)
    out["unknown"] = unk.save(os.path.join(root, "unknown"))
    nan = a.copy()
    k = sorted(n for n in nan.tensors if ".experts." in n and "lora_B" in n)[0]
    t = nan.tensors[k].clone()
    t[0, 0] = float("nan")
    nan.tensors[k] = t
    out["nan"] = nan.save(os.path.join(root, "nan"))
    out["missing"] = os.path.join(root, "does-not-exist")
    kvb = random_adapter(config, LoraSpec(rank=8, alpha=8.0, target_modules=("kv_b_proj",)), seed=4)
    out["kv_b"] = kvb.save(os.path.join(root, "kv_b"))
    return out
