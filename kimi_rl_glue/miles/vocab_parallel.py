"""Log-probabilities at given token ids from vocabulary-parallel logits (each TP rank holds a vocabulary slice).

Megatron splits the output layer over the tensor-parallel group: rank ``r`` of ``tp`` holds the logits of
the ids ``[r * V_local, (r + 1) * V_local)``. The log-softmax at an id needs the normaliser over the whole
vocabulary, built as Megatron's vocab-parallel cross-entropy builds it
(``NVIDIA/Megatron-LM:megatron/core/tensor_parallel/cross_entropy.py``)::

    m     = all_reduce_max(max_local x)                      (detached: the softmax does not depend on it)
    Z     = all_reduce_sum(sum_local exp(x - m))
    x_id  = all_reduce_sum(x_local[id - start] if id is on this rank else 0)
    log p = x_id - m - log Z

Every TP rank computes the same loss from these reduced values and back-propagates its own copy, so the
two sums are all-reduced in the forward and pass the gradient through unchanged in the backward (Megatron's
"reduce from the tensor-parallel region"): rank ``r`` then gets exactly ``d loss / d x_local``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["log_probs_at"]


class _SumOverTensorParallel(torch.autograd.Function):
    """Forward: all-reduce sum over ``group``; backward: identity (the loss is replicated on the group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def log_probs_at(
    logits: torch.Tensor, ids: torch.Tensor, *, group=None, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """``log_softmax(full logits)[n, ids[n, j]]`` from this rank's vocabulary slice.

    :param logits: ``[N, V_local]`` float (fp32 or fp64; bf16 is upcast to fp32); this rank's slice, ids
        ``[tp_rank * V_local, (tp_rank + 1) * V_local)``. Carries the gradient.
    :param ids: ``[N, M]`` int, global token ids; ``-1`` marks padding (its entry is finite and meaningless:
        callers mask it).
    :param group: the tensor-parallel process group; ``None`` with ``tp_size == 1`` (full vocabulary).
    :returns: ``[N, M]`` log-probabilities, float64 if ``logits`` is float64 else float32, with gradient.
    :raises ValueError: ids outside ``[-1, tp_size * V_local)``.
    """
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"log_probs_at needs logits [N, V_local] and ids [N, M], got {tuple(logits.shape)}, {tuple(ids.shape)}"
        )
    if tp_size > 1 and group is None:
        raise ValueError(f"tp_size={tp_size} needs the tensor-parallel process group")
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dt)
    v_local = x.shape[-1]
    if ids.numel() and ((ids < -1) | (ids >= v_local * tp_size)).any():
        raise ValueError(f"token ids outside [-1, {v_local * tp_size}) (the vocabulary of the TP-{tp_size} logits)")
    start = tp_rank * v_local
    local = ids.long() - start
    on_rank = (local >= 0) & (local < v_local)
    picked = torch.where(on_rank, x.gather(-1, local.clamp(0, v_local - 1)), torch.zeros((), dtype=dt))
    with torch.no_grad():
        m = x.max(-1, keepdim=True).values if v_local else x.new_zeros(x.shape[0], 1)
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (x - m).exp().sum(-1, keepdim=True)
    if tp_size > 1:
        sum_exp = _SumOverTensorParallel.apply(sum_exp, group)
        picked = _SumOverTensorParallel.apply(picked, group)
    return picked - m - sum_exp.log()
