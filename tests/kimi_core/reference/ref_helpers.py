"""Helpers of the reference tests: tiny HF configs + in-memory weights, and a duck-typed LoRA adapter."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


def tiny(model: str, quant: str | None = None, layers: int | None = None, seed: int = 0, **text_overrides):
    """``(config dict, tensors)`` of a tiny ``model`` from ``kimi_core.checkpoint.tiny``, text config overridable."""
    from kimi_core.checkpoint.tiny import tiny_config, tiny_state_dict

    cfg = tiny_config(model, quant, layers)
    text = cfg if model == "k2" else cfg["text_config"]
    text.update(copy.deepcopy(text_overrides))
    q = quant or ("mxfp4" if model in ("k3", "k31") else "int4")
    return cfg, tiny_state_dict(cfg, q, seed=seed)


@dataclass
class Factors:
    """Same fields as ``kimi_core.lora.LoraFactors``: ``A [r, in]``, ``B [out, r]`` fp32, ``scaling``."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float


class DictAdapter:
    """Duck-typed ``ResolvedAdapter``: ``dense(module)`` and ``expert(moe_module, e, proj)`` from dicts."""

    def __init__(self, dense: dict[str, Factors], experts: dict[tuple[str, int, str], Factors]):
        self._dense, self._experts = dense, experts

    def dense(self, module: str):
        return self._dense.get(module)

    def expert(self, moe_module: str, expert: int, proj: str):
        return self._experts.get((moe_module, expert, proj))
