"""adapter_nbytes: against the seeds' figures on the real configs and against real tensors on tiny ones."""

from __future__ import annotations

import pytest
import torch

from kimi_core.lora import LoraSpec, adapter_nbytes, random_adapter

SKYRL_TARGETS = ("o_proj", "gate_proj", "up_proj", "down_proj")  # linear_proj, linear_fc1, linear_fc2


def test_k2_per_expert_rank32_is_about_41_gb(k2_real):
    """K2.x, rank 32, per-expert, no normalisation, SkyRL's targets: about 41 GB (SkyRL #2026)."""
    n = adapter_nbytes(k2_real, LoraSpec(rank=32, target_modules=SKYRL_TARGETS), "per_expert")
    experts = 60 * 384 * 3 * 32 * (7168 + 2048) * 2  # written out: layers x experts x projections x r(in+out) x bf16
    assert experts <= n < experts * 1.01
    assert abs(n / 41e9 - 1) < 0.03, n
    r4 = adapter_nbytes(k2_real, LoraSpec(rank=32, target_modules=SKYRL_TARGETS, normalize_moe_lora=True))
    assert r4 < n / 7  # rank 32 // top-8 = 4 per expert


def test_k3_shared_outer_rank32_is_46_to_48_gib(k3_real):
    """K3, rank 32, shared-outer experts (the miles recipe): 46-48 GB as the seeds say (GiB)."""
    n = adapter_nbytes(k3_real, LoraSpec(rank=32, expert_layout="shared_outer"), "shared_outer")
    assert 45 * 2**30 < n < 48.5 * 2**30, n / 2**30
    per_expert = adapter_nbytes(k3_real, LoraSpec(rank=32), "per_expert")
    assert per_expert == pytest.approx(92 * 896 * 3 * 32 * (3584 + 3072) * 2, rel=0.02)


@pytest.mark.parametrize(
    "spec_layout,layout,tie",
    [
        ("per_expert", "per_expert", False),
        ("per_expert", "per_expert_3d", False),
        ("per_expert", "stacked", False),
        ("per_expert", "stacked", True),
        ("shared_outer", "shared_outer", False),
        ("shared_outer", "per_expert", False),
    ],
)
def test_nbytes_equals_real_tensors(tiny, spec_layout, layout, tie):
    """On tiny configs the formula equals the bytes of a random adapter built in that layout."""
    spec = LoraSpec(rank=4, expert_layout=spec_layout, normalize_moe_lora=True)
    ad = random_adapter(tiny, spec, layout=layout, dtype=torch.bfloat16, tie_gate_up_a=tie)
    assert adapter_nbytes(tiny, spec, layout, tie_gate_up_a=tie) == ad.nbytes
