"""KL estimators and mismatch metrics (kimi_rl_glue/losses/kl.py) against closed forms and an exact KL."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.kl import kl_estimate, mismatch_metrics, train_rollout_kl, train_rollout_logprob_abs_diff


def test_estimators_match_closed_forms():
    """k1 = d, k2 = d^2/2, k3 = e^-d - 1 + d, low_var_kl = k3 with -d clamped to 20 and the result to [-10, 10]."""
    a = torch.tensor([-0.3, -2.0, 0.0, 1.5, -40.0], dtype=torch.float64)
    b = torch.tensor([-0.5, -0.1, 0.0, -0.5, 0.0], dtype=torch.float64)
    d = (a - b).tolist()
    assert_close("k1", torch.tensor(d, dtype=torch.float64), kl_estimate(a, b, "k1"), 1e-15)
    assert_close("k2", torch.tensor([x * x / 2 for x in d], dtype=torch.float64), kl_estimate(a, b, "k2"), 1e-15)
    assert_close(
        "k3", torch.tensor([math.exp(-x) - 1 + x for x in d], dtype=torch.float64), kl_estimate(a, b, "k3"), 1e-15
    )
    lv = [min(max(math.exp(min(-x, 20)) - 1 - min(-x, 20), -10), 10) for x in d]
    assert_close("low_var_kl", torch.tensor(lv, dtype=torch.float64), kl_estimate(a, b, "low_var_kl"), 1e-15)


def test_train_rollout_kl_estimates_kl_rollout_train():
    """Averaged over tokens drawn from the rollout policy, the per-token train_rollout_kl term equals KL(rollout || train)."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)  # rollout
    p = torch.softmax(q.log() + 0.3 * torch.randn(50, generator=g, dtype=torch.float64), -1)  # train
    per_token = kl_estimate(q.log(), p.log(), "k3")  # miles: low_var_kl(rollout, train)
    exact = (q * (q.log() - p.log())).sum()
    assert_close("E_q[k3]", exact.reshape(1), (q * per_token).sum().reshape(1), 1e-12)
    assert_close("low_var == k3 here", per_token, kl_estimate(q.log(), p.log(), "low_var_kl"), 1e-15)


def test_mismatch_metrics_are_masked_token_means():
    """Both metrics are means over valid tokens only; identical log-probs give exactly 0."""
    tr = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 99.0]], dtype=torch.float64)
    ro = torch.tensor([[-1.1, -2.0, -2.0], [-0.7, -0.5, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    diffs = [0.1, 0.0, 1.0, 0.2, 0.0]
    assert train_rollout_logprob_abs_diff(tr, ro, m).item() == pytest.approx(sum(diffs) / 5)
    ks = [math.exp(t - r) - 1 - (t - r) for t, r in [(-1, -1.1), (-2, -2), (-3, -2), (-0.5, -0.7), (-0.5, -0.5)]]
    assert train_rollout_kl(tr, ro, m).item() == pytest.approx(sum(ks) / 5)
    assert mismatch_metrics(tr, tr, m) == {"train_rollout_logprob_abs_diff": 0.0, "train_rollout_kl": 0.0}


def test_unknown_kind_names_flag():
    """An unknown estimator raises ValueError naming kl_loss_type."""
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
