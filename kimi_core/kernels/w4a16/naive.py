"""Pure-torch W4A16 grouped GEMM: the naive twin of every backend of :mod:`kimi_core.kernels.w4a16`.

Same signatures, semantics and returns as :func:`~kimi_core.kernels.w4a16.w4a16_grouped_gemm` and
:func:`~kimi_core.kernels.w4a16.w4a16_grouped_gemm_dgrad` (without ``path``): rows of ``x`` are sorted by expert,
each expert's weight is dequantized exactly (:func:`kimi_core.quant.dequantize`, bf16), the product is accumulated
in fp32 and rounded once to bf16. One expert is dequantized at a time, so memory stays bounded by one ``[N, K]``
weight. This is the path CPUs (CI, the CPU demo) take.
"""

from __future__ import annotations

import torch

from kimi_core.kernels.host_ints import host_offsets
from kimi_core.quant import dequantize
from kimi_core.quant.formats import WeightFormat, weight_format

__all__ = ["w4a16_grouped_gemm", "w4a16_grouped_gemm_dgrad"]


def w4a16_grouped_gemm(
    x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str | WeightFormat, m_splits
) -> torch.Tensor:
    """``y [T, N]`` bf16 with ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` (fp32 accumulation); ``x`` ``[T, K]``
    bf16, ``w_packed`` / ``w_scale`` ``[E, N, ...]`` in ``fmt``'s on-disk layout, ``m_splits`` ``E`` row counts."""
    name = weight_format(fmt).name
    off = host_offsets(m_splits)
    y = torch.empty((x.shape[0], w_packed.shape[1]), dtype=torch.bfloat16, device=x.device)
    for e in range(w_packed.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        w = dequantize(name, w_packed[e], w_scale[e], torch.bfloat16)  # [N, K]
        y[lo:hi] = (x[lo:hi].float() @ w.float().t()).to(torch.bfloat16)
    return y


def w4a16_grouped_gemm_dgrad(
    dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str | WeightFormat, m_splits
) -> torch.Tensor:
    """``dx [T, K]`` bf16 with ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` (fp32 accumulation); ``dy`` ``[T, N]``
    bf16, the other arguments as :func:`w4a16_grouped_gemm`."""
    name = weight_format(fmt).name
    off = host_offsets(m_splits)
    K = w_scale.shape[-1] * 32
    dx = torch.empty((dy.shape[0], K), dtype=torch.bfloat16, device=dy.device)
    for e in range(w_packed.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        w = dequantize(name, w_packed[e], w_scale[e], torch.bfloat16)  # [N, K]
        dx[lo:hi] = (dy[lo:hi].float() @ w.float()).to(torch.bfloat16)
    return dx
