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

__all__ = ["causal_attention", "uses_fused_attention"]


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


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax attention ``[B, n, S, dv]`` of ``q``/``k [B, n, S, dqk]``, ``v [B, n, S, dv]``.

    :param cu_seqlens: optional ``[N + 1]`` int cumulative lengths of packed sequences along S (``B == 1``):
        no token attends across a boundary.
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"causal_attention: packed sequences (cu_seqlens) need batch 1, got q {tuple(q.shape)}")
    if uses_fused_attention(q):
        if cu_seqlens is None:
            return _sdpa(q, k, v, scale)
        bounds = cu_seqlens.tolist()
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # padding after the last sequence attends only itself
        parts = [_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale) for s, e in zip(bounds, bounds[1:]) if e > s]
        return torch.cat(parts, dim=2)
    seg = None if cu_seqlens is None else segment_ids(cu_seqlens, q.shape[2])
    return blockwise_causal_attention(q, k, v, scale, seg)
