"""Adapters the engine tests load: two good versions (per-expert and shared-outer, capacity-normalised
expert ranks via ``rank_pattern``) and one bad adapter per rejection reason."""

from __future__ import annotations

import os

import torch

from kimi_core.lora import LoraSpec, random_adapter

#: engine max_lora_rank; dense rank 16, experts 16 // top_k(4) = 4 through rank_pattern
MAX_LORA_RANK = 16


def spec(layout: str) -> LoraSpec:
    # kv_b_proj is absorbed into vLLM's MLA kernel (kimi_vllm_plugin.adapters.UNSERVED_LORA_MODULES)
    return LoraSpec(
        rank=16,
        alpha=32.0,
        target_modules="all-linear",
        exclude_modules=("kv_b_proj",),
        expert_layout=layout,
        normalize_moe_lora=True,
    )


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


#: one adapter family at a time (the GPU lane's narrowing set): tag -> LoraSpec target_modules
FAMILIES = {
    "attn": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"),
    "q_b": ("q_b_proj",),
    "kv_a": ("kv_a_proj_with_mqa",),
    "shared": ("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"),
    "dense": ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"),
    "experts": r".*\.experts\.\d+\.(gate|up|down)_proj",
}


def write_families(config, root: str) -> dict[str, str]:
    """Write one rank-16 adapter per :data:`FAMILIES` entry plus ``U`` (all-linear, routed experts at the
    same rank 16: no ``rank_pattern``) and ``experts_norm`` (routed experts only, capacity-normalised rank
    4 through ``rank_pattern``); returns ``{tag: path}``."""
    out = {}
    for i, (tag, targets) in enumerate(FAMILIES.items()):
        s = LoraSpec(rank=16, alpha=32.0, target_modules=targets)
        out[tag] = random_adapter(config, s, seed=10 + i, b_std=0.3).save(os.path.join(root, tag))
    s = LoraSpec(rank=16, alpha=32.0, target_modules=FAMILIES["experts"], normalize_moe_lora=True)
    out["experts_norm"] = random_adapter(config, s, seed=30, b_std=0.3).save(os.path.join(root, "experts_norm"))
    s = LoraSpec(rank=16, alpha=32.0, target_modules="all-linear", exclude_modules=("kv_b_proj",))
    out["U"] = random_adapter(config, s, seed=31, b_std=0.3).save(os.path.join(root, "U"))
    return out
