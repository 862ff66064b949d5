"""Pure-torch W4A16 grouped GEMM: the naive twin of :mod:`kimi_core.kernels.triton_w4a16`.

Same signatures and semantics as the Triton kernels: rows of ``x`` are sorted by expert, each
expert's weight is dequantized exactly (:func:`kimi_core.quant.dequantize`, bf16), the product is
accumulated in fp32 and rounded once to bf16. One expert is dequantized at a time, so memory stays
bounded by one ``[N, K]`` weight. This is the path CPUs (CI, the CPU demo) take.
"""

from __future__ import annotations

import torch

from kimi_core.quant import dequantize


def _bounds(m_splits) -> list[int]:
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
    off = [0]
    for v in splits:
        off.append(off[-1] + int(v))
    return off


def w4a16_grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                       m_splits) -> torch.Tensor:
    """``y[T, N]`` bf16 with ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` (fp32 accumulation)."""
    off = _bounds(m_splits)
    y = torch.empty((x.shape[0], w_packed.shape[1]), dtype=torch.bfloat16, device=x.device)
    for e in range(w_packed.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        w = dequantize(fmt, w_packed[e], w_scale[e], torch.bfloat16)  # [N, K]
        y[lo:hi] = (x[lo:hi].float() @ w.float().t()).to(torch.bfloat16)
    return y


def w4a16_grouped_gemm_dgrad(dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                             m_splits) -> torch.Tensor:
    """``dx[T, K]`` bf16 with ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` (fp32 accumulation)."""
    off = _bounds(m_splits)
    K = w_scale.shape[-1] * 32
    dx = torch.empty((dy.shape[0], K), dtype=torch.bfloat16, device=dy.device)
    for e in range(w_packed.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        w = dequantize(fmt, w_packed[e], w_scale[e], torch.bfloat16)  # [N, K]
        dx[lo:hi] = (dy[lo:hi].float() @ w.float()).to(torch.bfloat16)
    return dx
