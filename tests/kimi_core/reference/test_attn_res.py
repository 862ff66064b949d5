"""Attention-residual oracle: the aggregator vs a float64 formula, and the bank schedule's snapshot count."""

from __future__ import annotations

import math

import pytest
import torch
from ref_helpers import tiny
from utils import assert_close

from kimi_core.reference import KimiReferenceModel
from kimi_core.reference.attn_res import attn_res_aggregate


@pytest.mark.parametrize(
    "n_bank", [pytest.param(0, id="bank0"), pytest.param(1, id="bank1"), pytest.param(4, id="bank4")]
)
def test_aggregator_matches_float64_formula(n_bank):
    """attn_res_aggregate (fp32) equals softmax_i(<RMSNorm(row_i) * w_n, w_p>)-weighted rows, then the out-norm, in float64."""
    torch.manual_seed(n_bank)
    H, eps = 40, 1e-5
    rows = [torch.randn(2, 7, H) * (1 + i) for i in range(n_bank + 1)]
    w_n, w_p, w_o = 1 + 0.1 * torch.randn(H), torch.randn(1, H), 1 + 0.1 * torch.randn(H)
    got = attn_res_aggregate(rows[-1], rows[:-1], w_n, w_p, eps, w_o)
    R = torch.stack([r.double() for r in rows])
    keys = R / torch.sqrt((R**2).mean(-1, keepdim=True) + eps) * w_n.double()
    score = (keys * w_p.double()[0]).sum(-1)
    alpha = torch.exp(score - score.max(0).values) / torch.exp(score - score.max(0).values).sum(0)
    mixed = (alpha[..., None] * R).sum(0)
    ref = mixed / torch.sqrt((mixed**2).mean(-1, keepdim=True) + eps) * w_o.double()
    assert_close("aggregate", ref, got, 1e-6)
    no_norm = attn_res_aggregate(rows[-1], rows[:-1], w_n, w_p, eps, None)
    assert_close("aggregate (identity out-norm)", mixed, no_norm, 1e-6)


@pytest.mark.parametrize(
    "layers,block",
    [pytest.param(L, b, id=f"L{L}-block{b}") for L, b in [(2, 1), (3, 2), (6, 2), (5, 3), (6, 4), (4, 12)]],
)
def test_bank_holds_ceil_l_over_block(layers, block):
    """After L layers the residual bank holds ceil(L / block) snapshots, each [B, T, H]."""
    cfg, sd = tiny("k3", quant="none", layers=layers, attn_res_block_size=block)
    model = KimiReferenceModel.from_state_dict(cfg, sd)
    state = model.prefill(torch.randint(0, 1024, (2, 5)))
    assert len(state.bank) == math.ceil(layers / block) == model.config.num_attn_res_snapshots()
    assert all(b.shape == (2, 5, 256) for b in state.bank)
