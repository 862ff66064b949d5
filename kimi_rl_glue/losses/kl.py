"""KL estimators (Schulman, http://joschu.net/blog/kl-approx.html) and train/rollout mismatch metrics.

``kl_estimate(lp, lp_base, kind)`` estimates ``KL(pi || pi_base)`` at tokens sampled from ``pi``
with ``d = lp - lp_base``::

    k1 = d      k2 = d^2 / 2      k3 = exp(-d) - 1 + d
    low_var_kl = clamp(k3 with -d clamped to [-20, 20], -10, 10)

as miles' ``compute_approx_kl``. miles reports ``train_rollout_kl`` as the ``low_var_kl`` of
``(rollout, train)``, i.e. a k3 estimate of ``KL(rollout || train)`` at the sampled tokens:
``exp(train - rollout) - 1 - (train - rollout)``; and ``train_rollout_logprob_abs_diff`` as the
mean ``|train - rollout|``. Both are averaged over valid tokens here (``token_mean``).
"""

from __future__ import annotations

import torch

from kimi_rl_glue.losses.reduction import check_same_shape, reduce_tokens

__all__ = ["KL_KINDS", "kl_estimate", "train_rollout_kl", "train_rollout_logprob_abs_diff", "mismatch_metrics"]

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate, float32 (float64 for float64 inputs), same shape as the inputs."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl_loss_type={kind!r}; expected one of {KL_KINDS}")
    check_same_shape("log_probs", log_probs, log_probs_base=log_probs_base)
    dt = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    d = log_probs.to(dt) - log_probs_base.to(dt)
    if kind == "k1":
        return d
    if kind == "k2":
        return d.pow(2) / 2
    neg = -d
    if kind == "low_var_kl":
        neg = torch.nan_to_num(neg, nan=0.0, posinf=20.0, neginf=-20.0).clamp(-20.0, 20.0)
    kl = neg.exp() - 1 - neg
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


def train_rollout_kl(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "token_mean",
) -> torch.Tensor:
    """miles' ``train_rollout_kl``: reduced ``low_var_kl(rollout, train)``; 0-d, detached."""
    with torch.no_grad():
        kl = kl_estimate(rollout_log_probs.detach(), train_log_probs.detach(), "low_var_kl")
        return reduce_tokens(torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0), mask, reduction)


def train_rollout_logprob_abs_diff(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "token_mean",
) -> torch.Tensor:
    """miles' ``train_rollout_logprob_abs_diff``: reduced ``|train - rollout|``; 0-d, detached."""
    check_same_shape("train_log_probs", train_log_probs, rollout_log_probs=rollout_log_probs)
    with torch.no_grad():
        d = (train_log_probs.detach().double() - rollout_log_probs.detach().double()).abs()
        return reduce_tokens(torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0), mask, reduction)


def mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Both metrics as floats under miles' names (token mean)."""
    return {
        "train_rollout_logprob_abs_diff": float(
            train_rollout_logprob_abs_diff(train_log_probs, rollout_log_probs, mask)
        ),
        "train_rollout_kl": float(train_rollout_kl(train_log_probs, rollout_log_probs, mask)),
    }
