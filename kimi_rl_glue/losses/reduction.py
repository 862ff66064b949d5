"""Masked reductions of per-token losses shared by every loss in this package.

Conventions used across ``kimi_rl_glue.losses``: token tensors are right-padded batches
``[B, T]`` (any float dtype) with a ``mask [B, T]`` (bool or 0/1 float) that is 1 on response
tokens that carry loss. Reductions return a 0-d tensor in the input's dtype.

- ``token_mean``: ``sum(l * m) / max(sum(m), 1)``: every valid token weighs the same (DAPO).
- ``sequence_mean``: mean over sequences of each sequence's token mean (GRPO paper).
- ``sum``: ``sum(l * m)``: for hosts that pre-scale advantages (SkyRL, see ``kimi_rl_glue.skyrl``).
"""

from __future__ import annotations

import torch

__all__ = ["REDUCTIONS", "masked_mean", "reduce_tokens", "check_same_shape"]

REDUCTIONS = ("token_mean", "sequence_mean", "sum")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the tensor whose shape differs from ``ref``'s."""
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} (the shape of {ref_name})"
            )


def _mask_like(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(values)
    check_same_shape("values", values, mask=mask)
    return mask.to(values.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (all of ``values`` when ``mask`` is None); 0 where nothing is valid.

    Masked-out entries are replaced by 0 first so a NaN/inf in padding never leaks into the result.
    """
    m = _mask_like(values, mask)
    v = torch.where(m > 0, values, torch.zeros_like(values))
    if dim is None:
        return (v * m).sum() / m.sum().clamp(min=1)
    return (v * m).sum(dim) / m.sum(dim).clamp(min=1)


def reduce_tokens(loss: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """Reduce a per-token ``loss [B, T]`` to a scalar with one of :data:`REDUCTIONS`.

    :param loss: ``[B, T]`` per-token loss (``[N]`` is accepted for ``token_mean`` and ``sum``).
    :param mask: same shape as ``loss``; None means every token is valid.
    :param reduction: ``"token_mean"``, ``"sequence_mean"`` or ``"sum"``.
    """
    m = _mask_like(loss, mask)
    v = torch.where(m > 0, loss, torch.zeros_like(loss))
    if reduction == "token_mean":
        return (v * m).sum() / m.sum().clamp(min=1)
    if reduction == "sum":
        return (v * m).sum()
    if reduction == "sequence_mean":
        if loss.dim() != 2:
            raise ValueError(f"loss_reduction='sequence_mean' needs a [B, T] loss, got shape {tuple(loss.shape)}")
        per_seq = (v * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.mean() if per_seq.numel() else per_seq.sum()
    raise ValueError(f"loss_reduction={reduction!r}; expected one of {REDUCTIONS}")
