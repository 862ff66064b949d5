"""Our SkyRL losses inside the REAL skyrl 0.4.0 ``PolicyLossRegistry``, called as SkyRL's workers call them.

Oracles: SkyRL's own ``dual_clip`` / ``regular`` losses (same clip-higher, dual-clip and TIS
semantics), and a float64 recomputation written out here. Inputs are SkyRL-shaped: ``[B, T]``
float32 log-probs, a float loss mask, rollout log-probs; ``config`` is SkyRL's ``AlgorithmConfig``.
"""

from __future__ import annotations

import pytest
import torch
from py312_lane import require

ppo = require("skyrl.backends.skyrl_train.utils.ppo_utils", "skyrl==0.4.0")
from skyrl.train.config import AlgorithmConfig, OffPolicyCorrectionConfig
from utils import assert_close

from kimi_rl_glue.skyrl.losses import kimi_dapo_policy_loss, kimi_grpo_policy_loss
from kimi_rl_glue.skyrl.registry import SKYRL_LOSSES, register_skyrl_losses

R = ppo.PolicyLossRegistry


@pytest.fixture
def registered():
    """Our losses in SkyRL's registry for one test, removed afterwards (the registry is process-global)."""
    added = register_skyrl_losses()
    yield added
    for name in SKYRL_LOSSES:
        if name in R.list_available():
            R.unregister(name)


def _inputs(B=5, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g)
    lp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)
    roll = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    return lp, old, adv, mask, roll


def _cfg(loss_type: str, tis: str | None) -> AlgorithmConfig:
    return AlgorithmConfig(
        policy_loss_type=loss_type,
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        clip_ratio_c=10.0,
        off_policy_correction=OffPolicyCorrectionConfig(
            tis_ratio_type=tis, token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=5.0
        ),
    )


def _float64(lp, old, adv, mask, roll, cfg: AlgorithmConfig, dual: bool) -> float:
    """The clipped surrogate written out in float64: ``sum(mask * w * max(-r A, -clip(r) A) [dual: min(., -c A) if A < 0])``."""
    lp, old, adv, mask, roll = (t.detach().double() for t in (lp, old, adv, mask, roll))
    r = torch.exp(lp - old)
    loss = torch.maximum(-r * adv, -r.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high) * adv)
    if dual:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * cfg.clip_ratio_c), loss)
    opc = cfg.off_policy_correction
    if opc.tis_ratio_type == "token":
        loss = loss * torch.exp(old - roll).clamp(max=opc.token_tis_ratio_clip_high)
    elif opc.tis_ratio_type == "sequence":
        w = torch.exp(((old - roll) * mask).sum(-1, keepdim=True)).clamp(max=opc.sequence_tis_ratio_clip_high)
        loss = loss * w
    return float((loss * mask).sum())


def test_registered_and_resolved_by_skyrl(registered):
    """register_skyrl_losses() puts kimi_dapo / kimi_grpo into SkyRL's PolicyLossRegistry; SkyRL's get() returns them; a repeat registers nothing."""
    assert sorted(registered) == ["kimi_dapo", "kimi_grpo"]
    assert {"kimi_dapo", "kimi_grpo", "dual_clip", "regular"} <= set(R.list_available())
    assert R.get("kimi_dapo") is kimi_dapo_policy_loss and R.get("kimi_grpo") is kimi_grpo_policy_loss
    assert register_skyrl_losses() == []


def test_conflicting_name_is_refused(registered):
    """A name SkyRL already holds for another function is an error naming both, not a silent override."""
    with pytest.raises(ValueError, match=r"'dual_clip' is already registered to .*ppo_policy_loss"):
        register_skyrl_losses(losses={"dual_clip": kimi_dapo_policy_loss})


@pytest.mark.parametrize("tis", [None, "token", "sequence"])
@pytest.mark.parametrize("ours,theirs,dual", [("kimi_dapo", "dual_clip", True), ("kimi_grpo", "regular", False)])
def test_loss_equals_skyrl_builtin_and_float64(registered, ours, theirs, dual, tis):
    """Looked up by name, our loss equals SkyRL's own clip loss (value, clip_ratio, TIS metrics, gradient) and a float64 recomputation."""
    lp, old, adv, mask, roll = _inputs()
    cfg_ours, cfg_theirs = _cfg(ours, tis), _cfg(theirs, tis)
    got, got_m = R.get(cfg_ours.policy_loss_type)(lp, old, adv, cfg_ours, mask, roll)
    (g_got,) = torch.autograd.grad(got, lp)
    ref, ref_m = R.get(theirs)(lp, old, adv, cfg_theirs, mask, roll)
    (g_ref,) = torch.autograd.grad(ref, lp)
    assert got.dim() == 0 and got.dtype == torch.float32
    assert_close(f"{ours}/{tis} vs skyrl {theirs}", ref, got, 1e-6)
    assert_close(f"{ours}/{tis} grad vs skyrl {theirs}", g_ref, g_got, 1e-6)
    f64 = _float64(lp, old, adv, mask, roll, cfg_ours, dual)
    assert abs(got.item() - f64) <= 1e-5 * max(1.0, abs(f64)), (got.item(), f64)
    assert got_m["clip_ratio"] == pytest.approx(ref_m["clip_ratio"], abs=1e-7)
    for k, v in ref_m.items():  # SkyRL's TIS metrics, under SkyRL's names
        if k.startswith("tis_") or k == "is_ratio_mean":
            assert got_m.get(k) == pytest.approx(v, rel=1e-6), k


def test_skyrl_mask_options_refused_by_name(registered):
    """SkyRL features our losses do not implement (sequence / outlier masks) raise naming the key instead of being ignored."""
    lp, old, adv, mask, roll = _inputs()
    cfg = _cfg("kimi_dapo", "token")
    cfg.off_policy_correction.sequence_mask_metric = "geometric"
    with pytest.raises(ValueError, match="off_policy_correction.sequence_mask_metric"):
        R.get("kimi_dapo")(lp, old, adv, cfg, mask, roll)
