"""TIS weights (kimi_rl_glue/losses/tis.py) against a hand loop with SkyRL's semantics."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.tis import apply_tis, tis_weights


def _data():
    old = torch.tensor([[-1.0, -0.2, -3.0, 0.0], [-0.5, -25.0, -0.1, -9.0]], dtype=torch.float64)
    roll = torch.tensor([[-1.5, -0.1, -0.2, 0.0], [-31.0, -1.0, -0.1, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    return old, roll, mask


def _safe_exp(x: float) -> float:
    return math.exp(min(max(x, -20.0), 20.0))


@pytest.mark.parametrize("cap", [2.0, 1e12], ids=["cap2", "cap1e12"])
def test_token_caps_match_loop(cap):
    """Token weight = min(exp(clamp(old - rollout, -20, 20)), cap), no lower truncation, detached."""
    old, roll, mask = _data()
    w, m = tis_weights(old.clone().requires_grad_(True), roll, mask, tis_type="token", token_cap=cap)
    ref = torch.tensor(
        [[min(_safe_exp(float(o - r)), cap) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, roll)],
        dtype=torch.float64,
    )
    assert_close("token tis", ref, w, 1e-15)
    assert not w.requires_grad
    assert w[1, 0].item() == pytest.approx(math.exp(20.0) if cap > 1e10 else cap)  # exponent clipped at 20
    assert w[1, 1].item() == pytest.approx(math.exp(-20.0))  # no lower truncation
    n_capped = sum(
        1 for b in range(2) for t in range(4) if mask[b, t] and _safe_exp(float(old[b, t] - roll[b, t])) > cap
    )
    assert m["tis_token_clip_high_ratio"] == pytest.approx(n_capped / 7)


@pytest.mark.parametrize("cap", [5.0, 0.5], ids=["cap5", "cap0.5"])
def test_sequence_caps_match_loop(cap):
    """Sequence weight = min(exp(clamp(sum over valid tokens of old - rollout, -20, 20)), cap), one per row."""
    old, roll, mask = _data()
    w, m = tis_weights(old, roll, mask, tis_type="sequence", sequence_cap=cap)
    ref = []
    for b in range(2):
        s = sum(float(old[b, t] - roll[b, t]) for t in range(4) if mask[b, t])
        ref.append([min(_safe_exp(s), cap)])
    assert_close("seq tis", torch.tensor(ref, dtype=torch.float64), w, 1e-15)
    assert w.shape == (2, 1)


def test_apply_tis_multiplies_and_off_is_identity():
    """apply_tis multiplies the per-token loss by the weight; tis_type=None returns the loss unchanged."""
    old, roll, mask = _data()
    loss = torch.randn(2, 4, dtype=torch.float64)
    out, _ = apply_tis(loss, old, roll, mask, "token", token_cap=3.0)
    assert_close("applied", loss * (old - roll).clamp(-20, 20).exp().clamp(max=3.0), out, 1e-15)
    same, metrics = apply_tis(loss, old, None, mask, None)
    assert same is loss and metrics == {}


def test_padding_nan_does_not_leak_into_sequence_weight():
    """NaN log-probs at masked positions do not change the sequence weight."""
    old, roll, mask = _data()
    old2 = old.clone()
    old2[0, 3] = float("nan")
    a, _ = tis_weights(old, roll, mask, tis_type="sequence")
    b, _ = tis_weights(old2, roll, mask, tis_type="sequence")
    assert torch.equal(a, b)


def test_bad_type_names_flag():
    """An unknown TIS type raises ValueError naming tis_ratio_type."""
    old, roll, mask = _data()
    with pytest.raises(ValueError, match="tis_ratio_type"):
        tis_weights(old, roll, mask, tis_type="geometric")
