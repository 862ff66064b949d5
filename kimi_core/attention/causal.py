"""Causal attention entry point: torch's fused SDPA on CUDA, :mod:`kimi_core.attention.blockwise` elsewhere.

Both paths keep memory linear in the sequence length (SDPA's flash / memory-efficient / cuDNN backends
never materialise the ``S x S`` probabilities). Packed sequences (``cu_seqlens``) run SDPA once per
sequence on CUDA and through the blockwise kernel's segment mask elsewhere.

``KIMI_ATTENTION`` picks the path: ``auto`` (default: fused on CUDA), ``fused`` or ``blockwise``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kimi_core.attention.blockwise import blockwise_causal_attention, segment_ids

__all__ = ["causal_attention", "query_runs", "uses_fused_attention"]


def uses_fused_attention(q: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` takes torch's fused SDPA for ``q`` (CUDA, ``KIMI_ATTENTION`` not ``blockwise``)."""
    mode = os.environ.get("KIMI_ATTENTION", "auto")
    if mode not in ("auto", "fused", "blockwise"):
        raise ValueError(f"KIMI_ATTENTION={mode!r}: expected auto, fused or blockwise")
    if mode == "fused" and not q.is_cuda:
        raise ValueError("KIMI_ATTENTION=fused needs CUDA tensors (torch's fused SDPA backends)")
    return q.is_cuda and mode != "blockwise"


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # SDPA's memory-efficient and cuDNN backends take a v head dim (128) unlike q/k's (192); torch
    # picks the fastest backend that accepts the shapes and never the S x S math path if one does.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _sdpa_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of ``Lq`` queries that are the last ``Lq`` of ``Lk`` keys (causal mask aligned bottom-right)."""
    from torch.nn.attention.bias import causal_lower_right

    if q.shape[2] == k.shape[2]:
        return _sdpa(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


def query_runs(q_pos: torch.Tensor, seg: torch.Tensor | None) -> list[tuple[int, int, int, int]]:
    """``(qs, qe, ks, ke)``: query rows ``[qs, qe)`` hold consecutive key positions of one segment, and see the keys
    ``[ks, ke)`` (their segment's start to their last position + 1). A context-parallel rank has two runs per
    sequence. One host sync."""
    Sq = q_pos.shape[0]
    qseg = torch.zeros_like(q_pos) if seg is None else seg[q_pos]
    cut = (q_pos[1:] - q_pos[:-1] != 1) | (qseg[1:] != qseg[:-1])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=q_pos.device), cut.nonzero()[:, 0] + 1])
    ends = torch.cat([starts[1:], torch.tensor([Sq], device=q_pos.device)])
    first_key = torch.zeros_like(starts) if seg is None else torch.searchsorted(seg, qseg[starts].contiguous())
    rows = torch.stack([starts, ends, first_key, q_pos[ends - 1] + 1], dim=1)
    return [tuple(r) for r in rows.tolist()] if Sq else []


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention ``[B, n, Sq, dv]`` of ``q [B, n, Sq, dqk]`` over ``k [B, n, Sk, dqk]``, ``v [B, n, Sk, dv]``.

    :param cu_seqlens: optional ``[N + 1]`` int cumulative lengths of packed sequences along the keys (``B == 1``):
        no token attends across a boundary.
    :param q_pos: optional ``[Sq]`` int64 non-decreasing key positions of the queries (a context-parallel rank's
        tokens against the gathered sequence); default self-attention, ``Sq == Sk``. The fused path then runs SDPA
        once per run of consecutive positions (:func:`query_runs`) against its keys, bottom-right causal.
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"causal_attention: packed sequences (cu_seqlens) need batch 1, got q {tuple(q.shape)}")
    seg = None if cu_seqlens is None else segment_ids(cu_seqlens, k.shape[2])
    if uses_fused_attention(q):
        if q_pos is not None:
            parts = [
                _sdpa_lower_right(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], scale)
                for qs, qe, ks, ke in query_runs(q_pos, seg)
            ]
            return torch.cat(parts, dim=2)
        if cu_seqlens is None:
            return _sdpa(q, k, v, scale)
        bounds = cu_seqlens.tolist()
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # padding after the last sequence attends only itself
        parts = [_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale) for s, e in zip(bounds, bounds[1:]) if e > s]
        return torch.cat(parts, dim=2)
    return blockwise_causal_attention(q, k, v, scale, seg, q_pos=q_pos)
