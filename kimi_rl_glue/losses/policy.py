"""GRPO / DAPO clipped policy-gradient loss: clip-higher and dual-clip, with optional TIS.

Per token, with ``r = exp(clamp(log p - log p_old, -20, 20))`` and advantage ``A``::

    l_clip = -min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)        (PPO; eps_high > eps_low = clip-higher)
    l      = min(l_clip, -c A)  where A < 0, else l_clip                (dual-clip, c = clip_ratio_c > 1)

then ``l * w_TIS`` (see :mod:`kimi_rl_glue.losses.tis`) and a masked reduction. Same equations as
SkyRL's ``ppo_policy_loss`` (``regular``/``dual_clip``) and miles' ``compute_policy_loss``
(``--eps-clip``, ``--eps-clip-high``, ``--eps-clip-c``); DAPO's recipe is eps 0.2/0.28, c = 10,
``token_mean``. Our own code, written from those equations.
"""

from __future__ import annotations

import torch

from kimi_rl_glue.losses.reduction import check_same_shape, masked_mean, reduce_tokens
from kimi_rl_glue.losses.tis import EXP_CLIP, apply_tis

__all__ = ["clipped_pg_token_loss", "policy_loss"]


def clipped_pg_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 10.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unreduced clipped PG loss.

    :param log_probs: ``[*]`` current log-probs of the sampled tokens (gradient flows here).
    :param old_log_probs: ``[*]`` behaviour-policy log-probs (detached).
    :param advantages: ``[*]`` (detached).
    :param eps_low, eps_high: ratio clip range ``[1 - eps_low, 1 + eps_high]``.
    :param clip_ratio_c: dual-clip constant (> 1), or None for plain PPO clipping.
    :returns: ``(loss [*], clipped [*] bool, dual_clipped [*] bool)``; the loss is float32 (float64
        for float64 inputs) whatever the input dtype, so bf16 log-probs do not round the loss.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_clip_low={eps_low} and eps_clip_high={eps_high} must be >= 0")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 for dual-clip PPO (None turns it off)")
    dt = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    adv = advantages.detach().to(dt)
    ratio = (log_probs.to(dt) - old_log_probs.detach().to(dt)).clamp(-EXP_CLIP, EXP_CLIP).exp()
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(surr1, surr2)
    clipped = -surr2 > -surr1
    dual = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, clipped, dual


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 10.0,
    reduction: str = "token_mean",
    tis_type: str | None = None,
    token_tis_cap: float = 2.0,
    sequence_tis_cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reduced GRPO/DAPO loss with optional TIS.

    :param log_probs, old_log_probs, advantages: ``[B, T]`` (see :func:`clipped_pg_token_loss`).
    :param mask: ``[B, T]`` valid response tokens.
    :param rollout_log_probs: ``[B, T]`` inference-engine log-probs; needed when ``tis_type`` is set.
    :param reduction: ``"token_mean"``, ``"sequence_mean"`` or ``"sum"``.
    :param tis_type: None, ``"token"`` or ``"sequence"`` (weights from ``old`` vs ``rollout``).
    :returns: ``(loss 0-d, metrics)`` with floats ``clip_ratio`` (masked fraction where the clipped
        surrogate was taken), ``dual_clip_ratio``, ``ppo_kl`` (masked mean of ``old - log p``) and the
        TIS metrics.
    """
    loss, clipped, dual = clipped_pg_token_loss(
        log_probs, old_log_probs, advantages, eps_low=eps_low, eps_high=eps_high, clip_ratio_c=clip_ratio_c
    )
    loss, tis_metrics = apply_tis(
        loss, old_log_probs, rollout_log_probs, mask, tis_type, token_cap=token_tis_cap, sequence_cap=sequence_tis_cap
    )
    with torch.no_grad():
        metrics = {
            "clip_ratio": float(masked_mean(clipped.float(), None if mask is None else mask.float())),
            "dual_clip_ratio": float(masked_mean(dual.float(), None if mask is None else mask.float())),
            "ppo_kl": float(
                masked_mean((old_log_probs - log_probs).detach().float(), None if mask is None else mask.float())
            ),
        }
    metrics.update(tis_metrics)
    return reduce_tokens(loss, mask, reduction), metrics
