"""Truncated importance sampling (TIS) with SkyRL's semantics.

Facts from SkyRL (``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``; our own code):

- token ratio ``r_t = exp(clamp(old_t - rollout_t, -20, 20))`` computed in float32 ("safe exp");
- ``"token"``: weight ``min(r_t, token_cap)`` per token (default cap 2.0);
- ``"sequence"``: weight ``min(exp(clamp(sum_t m_t (old_t - rollout_t), -20, 20)), sequence_cap)`` per
  sequence (default cap 5.0), broadcast over its tokens;
- the weight is detached and **multiplies the per-token PG loss**; there is no lower truncation.

``old`` is the trainer's log-prob under the policy that produced the rollout (recomputed by the
trainer); ``rollout`` is the inference engine's log-prob of the same token.
"""

from __future__ import annotations

import torch

from kimi_rl_glue.losses.reduction import check_same_shape, masked_mean

__all__ = ["TIS_TYPES", "EXP_CLIP", "safe_exp", "tis_weights", "apply_tis"]

TIS_TYPES = ("token", "sequence")
EXP_CLIP = 20.0


def safe_exp(delta: torch.Tensor, clip: float = EXP_CLIP) -> torch.Tensor:
    """``exp(clamp(delta, -clip, clip))`` in float32 (float64 stays float64)."""
    dt = torch.float64 if delta.dtype == torch.float64 else torch.float32
    return delta.to(dt).clamp(-clip, clip).exp()


def tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    tis_type: str = "token",
    token_cap: float = 2.0,
    sequence_cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached TIS weights.

    :param old_log_probs: ``[B, T]`` trainer log-probs of the sampled tokens.
    :param rollout_log_probs: ``[B, T]`` inference-engine log-probs of the same tokens.
    :param mask: ``[B, T]`` valid response tokens (None = all).
    :param tis_type: ``"token"`` (SkyRL ``tis_ratio_type=token``) or ``"sequence"``.
    :param token_cap: ``token_tis_ratio_clip_high``; :param sequence_cap: ``sequence_tis_ratio_clip_high``.
    :returns: ``(weights, metrics)``: ``weights`` is ``[B, T]`` (token) or ``[B, 1]`` (sequence), float32
        (float64 for float64 inputs), detached; metrics ``tis_token_clip_high_ratio`` or
        ``tis_seq_clip_high_ratio`` (fraction capped) and ``is_ratio_mean`` (masked mean of ``r_t``).
    """
    if tis_type not in TIS_TYPES:
        raise ValueError(f"tis_ratio_type={tis_type!r}; expected one of {TIS_TYPES} or None (off)")
    check_same_shape("old_log_probs", old_log_probs, rollout_log_probs=rollout_log_probs, mask=mask)
    with torch.no_grad():
        delta = (
            old_log_probs.detach().double() if old_log_probs.dtype == torch.float64 else old_log_probs.detach().float()
        )
        delta = delta - rollout_log_probs.detach().to(delta.dtype)
        m = torch.ones_like(delta) if mask is None else mask.to(delta.dtype)
        ratio = safe_exp(delta)
        metrics = {"is_ratio_mean": float(masked_mean(ratio, m))}
        if tis_type == "token":
            if not token_cap > 0:
                raise ValueError(f"token_tis_ratio_clip_high={token_cap} must be > 0")
            capped = (ratio > token_cap) & (m > 0)
            metrics["tis_token_clip_high_ratio"] = float(capped.sum() / (m > 0).sum().clamp(min=1))
            return ratio.clamp(max=token_cap), metrics
        if delta.dim() != 2:
            raise ValueError(f"tis_ratio_type='sequence' needs [B, T] log-probs, got {tuple(delta.shape)}")
        if not sequence_cap > 0:
            raise ValueError(f"sequence_tis_ratio_clip_high={sequence_cap} must be > 0")
        # Padding is zeroed first so NaN/inf there never reaches the product.
        seq_log = torch.where(m > 0, delta, torch.zeros_like(delta)).mul(m).sum(-1, keepdim=True)
        seq_ratio = safe_exp(seq_log)
        metrics["tis_seq_clip_high_ratio"] = (
            float((seq_ratio > sequence_cap).float().mean()) if seq_ratio.numel() else 0.0
        )
        return seq_ratio.clamp(max=sequence_cap), metrics


def apply_tis(
    pg_loss: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    mask: torch.Tensor | None,
    tis_type: str | None,
    *,
    token_cap: float = 2.0,
    sequence_cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Multiply a per-token ``pg_loss [B, T]`` by the TIS weight; identity when ``tis_type`` is None.

    :raises ValueError: TIS is on but ``rollout_log_probs`` is missing.
    """
    if tis_type is None:
        return pg_loss, {}
    if rollout_log_probs is None:
        raise ValueError(
            f"tis_ratio_type={tis_type!r} needs rollout_log_probs (the inference engine's "
            "log-probs of the sampled tokens); the batch has none"
        )
    w, metrics = tis_weights(
        old_log_probs, rollout_log_probs, mask, tis_type=tis_type, token_cap=token_cap, sequence_cap=sequence_cap
    )
    return pg_loss * w.to(pg_loss.dtype), metrics
