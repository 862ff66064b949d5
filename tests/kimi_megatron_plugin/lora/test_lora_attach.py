"""``attach_lora`` marks the factors the way Megatron's DDP classifies parameters (``allreduce``): per-expert factors
are expert-parallel parameters (reduced over expert-DP, like Megatron's own expert weights), dense and shared-outer
factors are data-parallel ones; ``needs_ep_reduction`` names the shared-outer case under EP."""

from __future__ import annotations

import pytest

from kimi_core.lora import LoraSpec
from kimi_megatron_plugin.lora.attach import SLOT, attach_lora, needs_ep_reduction


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_megatron_ddp_classification(mcore_world, tiny_ckpt, layout):
    from kimi_megatron_plugin.models import provider

    model = provider.build_model_from_hf(tiny_ckpt("k2", layers=2), perform_initialization=False)
    lora = attach_lora(model, LoraSpec(rank=8, alpha=16, expert_layout=layout), seed=0)
    expert_parallel = {n for n, p in model.named_parameters() if p.requires_grad and not getattr(p, "allreduce", True)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(SLOT + ".") for n in trainable)
    per_expert = set()
    for key, experts in lora.experts.items():
        shared = {id(p) for p in experts.shared_parameters()}
        per_expert |= {f"{SLOT}.lora.experts.{key}.{n}" for n, p in experts.named_parameters() if id(p) not in shared}
    assert expert_parallel == per_expert and per_expert
    assert all(".experts." not in n or n in per_expert or layout == "shared_outer" for n in trainable)
    # one process: no EP group to sum over
    assert not needs_ep_reduction(lora)
    lora.par = dict(lora.par, ep=2)
    assert needs_ep_reduction(lora) == (layout == "shared_outer")
