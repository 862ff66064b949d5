"""GRPO/DAPO clipped policy loss (kimi_rl_glue/losses/policy.py) against a float64 element loop and its analytic gradient."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.policy import clipped_pg_token_loss, policy_loss


def _batch(seed: int, B: int, T: int, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lens[:, None]).double()
    return lp, old, roll, adv, mask


def _loop(lp, old, adv, mask, eps_low, eps_high, c, reduction, tis_w=None):
    """Loss and d loss / d lp, one token at a time in Python floats."""
    B, T = lp.shape
    L = [[0.0] * T for _ in range(B)]
    G = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            r = math.exp(min(max(float(lp[b, t] - old[b, t]), -20.0), 20.0))
            A = float(adv[b, t])
            s1, s2 = r * A, min(max(r, 1 - eps_low), 1 + eps_high) * A
            l, dl = (-s1, -A * r) if s1 <= s2 else (-s2, (-A * r if 1 - eps_low < r < 1 + eps_high else 0.0))
            if c is not None and A < 0 and -c * A < l:
                l, dl = -c * A, 0.0
            w = 1.0 if tis_w is None else float(tis_w[b, t] if tis_w.shape[1] == T else tis_w[b, 0])
            L[b][t], G[b][t] = l * w, dl * w
    L, G = torch.tensor(L, dtype=torch.float64), torch.tensor(G, dtype=torch.float64)
    if reduction == "token_mean":
        scale = mask / mask.sum()
    elif reduction == "sequence_mean":
        scale = mask / mask.sum(-1, keepdim=True) / B
    else:
        scale = mask
    return (L * scale).sum(), G * scale


CASES = [
    pytest.param(0.2, 0.28, 10.0, "token_mean", id="dapo-dual10-token_mean"),
    pytest.param(0.2, 0.2, None, "sequence_mean", id="grpo-noclipc-sequence_mean"),
    pytest.param(0.1, 0.3, 1.5, "sum", id="dual1.5-sum"),
]


@pytest.mark.parametrize("eps_low,eps_high,c,reduction", CASES)
@pytest.mark.parametrize("B,T", [(3, 5), (7, 13)], ids=["B3-T5", "B7-T13"])
def test_loss_and_gradient_match_loop(eps_low, eps_high, c, reduction, B, T):
    """Loss value and d/d log_probs equal the clip-higher/dual-clip formula evaluated token by token."""
    lp, old, _, adv, mask = _batch(B * 31 + T, B, T, spread=0.8 if c == 1.5 else 0.6)
    x = lp.clone().requires_grad_(True)
    got, metrics = policy_loss(
        x, old, adv, mask, eps_low=eps_low, eps_high=eps_high, clip_ratio_c=c, reduction=reduction
    )
    got.backward()
    ref, ref_grad = _loop(lp, old, adv, mask, eps_low, eps_high, c, reduction)
    assert_close("pg loss", ref.reshape(1), got.detach().reshape(1), 1e-12)
    assert_close("pg grad", ref_grad, x.grad, 1e-12)
    assert 0.0 <= metrics["clip_ratio"] <= 1.0 and 0.0 <= metrics["dual_clip_ratio"] <= 1.0


@pytest.mark.parametrize("tis_type", ["token", "sequence"])
def test_tis_multiplies_per_token_loss(tis_type):
    """With TIS on, the loss and gradient are the loop's per-token values times the detached capped ratio."""
    lp, old, roll, adv, mask = _batch(11, 4, 9)
    x = lp.clone().requires_grad_(True)
    got, metrics = policy_loss(x, old, adv, mask, roll, tis_type=tis_type, token_tis_cap=1.5, sequence_tis_cap=3.0)
    got.backward()
    d = old - roll
    if tis_type == "token":
        w = d.exp().clamp(max=1.5)
    else:
        w = (d * mask).sum(-1, keepdim=True).exp().clamp(max=3.0)
    ref, ref_grad = _loop(lp, old, adv, mask, 0.2, 0.28, 10.0, "token_mean", tis_w=w)
    assert_close("tis loss", ref.reshape(1), got.detach().reshape(1), 1e-12)
    assert_close("tis grad", ref_grad, x.grad, 1e-12)
    assert ("tis_token_clip_high_ratio" if tis_type == "token" else "tis_seq_clip_high_ratio") in metrics


def test_dual_clip_bounds_negative_advantage_loss():
    """For A < 0 and a huge ratio the dual-clip loss is exactly c*|A| and has zero gradient."""
    lp = torch.tensor([[5.0, 5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[-2.0, 2.0]], dtype=torch.float64)
    loss, clipped, dual = clipped_pg_token_loss(lp, old, adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    assert loss[0, 0].item() == 6.0 and dual.tolist() == [[True, False]]
    assert loss[0, 1].item() == pytest.approx(-2.0 * 1.28)
    loss.sum().backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]


def test_bf16_inputs_give_float32_loss():
    """bf16 log-probs are accepted and the loss is computed and returned in float32."""
    lp, old, _, adv, mask = _batch(5, 2, 6)
    got, _ = policy_loss(lp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    ref, _ = policy_loss(lp.bfloat16().double(), old.bfloat16().double(), adv.bfloat16().double(), mask)
    assert got.dtype == torch.float32
    assert_close("bf16", ref.reshape(1), got.double().reshape(1), 1e-6)


def test_errors_name_flag_and_tensor():
    """A dual-clip constant <= 1, a bad reduction, a shape mismatch and TIS without rollout log-probs raise clearly."""
    lp, old, _, adv, mask = _batch(6, 2, 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(lp, old, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_reduction"):
        policy_loss(lp, old, adv, mask, reduction="mean")
    with pytest.raises(ValueError, match="old_log_probs"):
        policy_loss(lp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(lp, old, adv, mask, None, tis_type="token")
