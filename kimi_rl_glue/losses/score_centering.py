"""Score centering (Marek & Ryabinin, "Score Centering Stabilizes Off-policy RL", arXiv 2609.20807).

Facts from miles' implementation, ``radixark/miles:miles/backends/training_utils/loss_hub/score_centering.py``
(this is our own code).

At one prefix: ``p`` is the trainer distribution, ``q`` the sampler's, ``H`` the sampler's stored
top-K candidates, ``A`` the detached advantage, ``f`` the importance function::

    none: f(x) = 1        tis: f(x) = min(x, c)        mis: f(x) = x * 1[lo <= x <= hi]
    rho   = max(1 - sum_H q, eps) / max(1 - sum_H p, eps)        (tail ratio)
    alpha = rho * f(1 / rho)
    loss  = -A * [ sg(f(p_a / q_a)) * log p_a  -  sum_{v in H} sg(q_v f(p_v / q_v) - alpha p_v) * log p_v ]

Why: outside ``H`` the sampler is modelled as ``q_hat = rho * p``; with ``s = grad log p`` and
``sum_v p_v s_v = 0`` the tail collapses onto the head terms, so ``-grad loss = A (w_a s_a - mu_w)``
with ``mu_w = E_{q_hat}[w s]``. Subtracting ``mu_w`` removes the drift ``E_q[A] mu`` from the policy
gradient. The sampled token always uses its recorded ``q_a``, even when it is outside ``H``.
``tests/kimi_rl_glue/test_score_centering.py`` checks that identity by autograd in float64.

Closed forms used below (no ``0 * inf``): ``q f(p/q)`` is ``q``, ``min(p, c q)`` and
``p * 1[lo <= p/q <= hi]``; ``alpha`` is ``rho``, ``min(1, c rho)`` and ``1[1/hi <= rho <= 1/lo]``.
"""

from __future__ import annotations

import math

import torch

from kimi_rl_glue.losses.reduction import check_same_shape

__all__ = ["IMPORTANCE_MODES", "importance_weight", "score_centering_loss", "score_centering_from_logits"]

IMPORTANCE_MODES = ("none", "tis", "mis")


def _check_mode(mode: str, tis_clip: float, mis_low: float, mis_high: float) -> None:
    if mode not in IMPORTANCE_MODES:
        raise ValueError(
            f"score_centering importance={mode!r}; expected one of {IMPORTANCE_MODES} (miles flag --score-centering-is)"
        )
    if mode == "tis" and not tis_clip > 0:
        raise ValueError(f"score_centering tis_clip={tis_clip} must be > 0")
    if mode == "mis" and not 0 < mis_low <= mis_high:
        raise ValueError(f"score_centering needs 0 < mis_low <= mis_high, got {mis_low}, {mis_high}")


def importance_weight(
    log_ratio: torch.Tensor, mode: str, *, tis_clip: float = 2.0, mis_low: float = 0.5, mis_high: float = 5.0
) -> torch.Tensor:
    """``f(exp(log_ratio))`` without exponentiating an unbounded ratio.

    :param log_ratio: any shape, float; ``log p - log q``.
    :param mode: ``"none"`` (1), ``"tis"`` (``min(x, tis_clip)``), ``"mis"`` (``x`` inside
        ``[mis_low, mis_high]``, else 0).
    :returns: same shape and dtype as ``log_ratio`` (no gradient is meant to flow: callers detach).
    """
    _check_mode(mode, tis_clip, mis_low, mis_high)
    if mode == "none":
        return torch.ones_like(log_ratio)
    if mode == "tis":
        return log_ratio.clamp(max=math.log(tis_clip)).exp()
    inside = (log_ratio >= math.log(mis_low)) & (log_ratio <= math.log(mis_high))
    return torch.where(inside, log_ratio.clamp(max=math.log(mis_high)).exp(), torch.zeros_like(log_ratio))


def score_centering_loss(
    log_probs: torch.Tensor,
    head_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    rollout_head_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    head_mask: torch.Tensor | None = None,
    *,
    importance: str = "none",
    tis_clip: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 5.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token score-centering loss and its per-token metrics (unreduced).

    :param log_probs: ``[*]`` trainer ``log p`` of the sampled token; carries the gradient.
    :param head_log_probs: ``[*, K]`` trainer ``log p`` at the sampler's top-K candidate ids; carries
        the gradient. Padded slots may hold anything (they are masked).
    :param rollout_log_probs: ``[*]`` sampler ``log q`` of the sampled token (recorded, detached).
    :param rollout_head_log_probs: ``[*, K]`` sampler ``log q`` of the candidates; padding is ``-inf``.
    :param advantages: ``[*]`` advantage per token (detached here).
    :param head_mask: ``[*, K]`` bool, True on real candidates; default ``isfinite(rollout_head_log_probs)``
        (miles pads ids with -1 and log-probs with -inf).
    :param importance: ``"none"``, ``"tis"`` or ``"mis"`` (miles ``--score-centering-is``).
    :param tis_clip: ``c`` of ``tis`` (miles default 2).
    :param mis_low, mis_high: band of ``mis`` (miles defaults 0.5, 5).
    :param eps: floor of both tail masses (1e-6, as the paper's appendix).
    :returns: ``(loss [*], metrics)``; metrics are detached ``[*]`` tensors: ``sc_correction``,
        ``sc_train_head_mass``, ``sc_rollout_head_mass``, ``sc_tail_ratio``, ``sc_importance_weight``.
        Compute runs in float32 (float64 if the inputs are float64).
    """
    _check_mode(importance, tis_clip, mis_low, mis_high)
    check_same_shape("log_probs", log_probs, rollout_log_probs=rollout_log_probs, advantages=advantages)
    check_same_shape(
        "head_log_probs", head_log_probs, rollout_head_log_probs=rollout_head_log_probs, head_mask=head_mask
    )
    if tuple(head_log_probs.shape[:-1]) != tuple(log_probs.shape):
        raise ValueError(
            f"head_log_probs has shape {tuple(head_log_probs.shape)}; expected "
            f"{tuple(log_probs.shape)} + [K] (log_probs' shape plus the candidate dim)"
        )
    dt = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    lp, hlp = log_probs.to(dt), head_log_probs.to(dt)
    rlp, rhlp = rollout_log_probs.detach().to(dt), rollout_head_log_probs.detach().to(dt)
    if head_mask is None:
        head_mask = torch.isfinite(rhlp)
    head_mask = head_mask.bool()
    # Padded slots get log p = 0 (not -inf) so they contribute 0 * 0 and a zero gradient.
    hlp = torch.where(head_mask, hlp, torch.zeros_like(hlp))
    with torch.no_grad():
        p = torch.where(head_mask, hlp.exp(), torch.zeros_like(hlp))
        q = torch.where(head_mask, rhlp.exp(), torch.zeros_like(hlp))
        p_mass, q_mass = p.sum(-1), q.sum(-1)
        rho = (1 - q_mass).clamp(min=eps) / (1 - p_mass).clamp(min=eps)
        if importance == "none":
            weighted_q, alpha = q, rho
        elif importance == "tis":
            weighted_q, alpha = torch.minimum(p, tis_clip * q), (tis_clip * rho).clamp(max=1.0)
        else:
            ratio_log = torch.where(head_mask, hlp - rhlp, torch.full_like(hlp, -math.inf))
            inside = (ratio_log >= math.log(mis_low)) & (ratio_log <= math.log(mis_high)) & head_mask
            weighted_q = torch.where(inside, p, torch.zeros_like(p))
            alpha = ((rho >= 1 / mis_high) & (rho <= 1 / mis_low)).to(dt)
        residual = weighted_q - alpha.unsqueeze(-1) * p
        weight = importance_weight(lp.detach() - rlp, importance, tis_clip=tis_clip, mis_low=mis_low, mis_high=mis_high)
    correction = (residual * hlp).sum(-1)
    loss = -advantages.detach().to(dt) * (weight * lp - correction)
    metrics = {
        "sc_correction": correction.detach(),
        "sc_train_head_mass": p_mass,
        "sc_rollout_head_mass": q_mass,
        "sc_tail_ratio": rho,
        "sc_importance_weight": weight,
    }
    return loss, metrics


def score_centering_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    topk_ids: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    rollout_topk_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    temperature: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Score centering from full-vocabulary logits (no tensor parallelism).

    :param logits: ``[*, V]`` trainer logits at the positions that predict ``tokens``.
    :param tokens: ``[*]`` int64 sampled token ids.
    :param topk_ids: ``[*, K]`` int sampler candidate ids, ``-1`` = padding.
    :param rollout_log_probs: ``[*]`` sampler ``log q`` of ``tokens``.
    :param rollout_topk_log_probs: ``[*, K]`` sampler ``log q`` of ``topk_ids`` (padding ``-inf``).
    :param advantages: ``[*]``.
    :param temperature: logits are divided by it (the sampler's temperature; score centering expects 1).
    :param kwargs: forwarded to :func:`score_centering_loss` (``importance``, ``tis_clip``...).
    :returns: ``(loss [*], metrics, log_probs [*])``; ``log_probs`` is the trainer's sampled-token
        log-prob (with gradient) for the train/rollout mismatch metrics.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for score centering")
    V = logits.shape[-1]
    if topk_ids.numel() and (((topk_ids < -1) | (topk_ids >= V)).any()):
        raise ValueError(f"topk_ids hold ids outside [-1, {V}) (vocabulary of the logits)")
    if tokens.numel() and ((tokens < 0) | (tokens >= V)).any():
        raise ValueError(f"tokens hold ids outside [0, {V}) (vocabulary of the logits)")
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dt) / temperature, dim=-1)
    lp = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    mask = topk_ids >= 0
    hlp = logp.gather(-1, topk_ids.long().clamp(min=0))
    loss, metrics = score_centering_loss(
        lp, hlp, rollout_log_probs, rollout_topk_log_probs, advantages, head_mask=mask, **kwargs
    )
    return loss, metrics, lp
