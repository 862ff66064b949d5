"""Batched transpose of the last two axes in tiles (Triton), for small-element tables such as W4A16 group scales.

``dst[b, c, r] = src[b, r, c]``. The Gluon dgrad (:mod:`kimi_core.kernels.w4a16.gluon`) needs the experts' group
scales ``[E, N, K / 32]`` as ``[E, K / 32, N]`` on every call. ``Tensor.copy_`` of the transposed view reads one byte
per thread at a ``K / 32``-byte stride, a tenth of the dgrad's own time (docs/performance.md#w4a16-launch-plans).
Here each program loads a ``[BLOCK_R, BLOCK_C]``
tile with rows along ``src``'s contiguous axis and stores it transposed with rows along ``dst``'s, so reads and
writes are both coalesced (the transpose itself goes through shared memory). Pure data movement: exact for any
dtype. Shapes: ``src`` ``[B, R, C]`` with unit stride on ``C``; ``dst`` ``[B, C, R]`` with unit stride on ``R``
(its row stride may be padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 64
BLOCK_C = 64


@triton.jit
def transpose_kernel(
    src_ptr, dst_ptr, R, C, stride_sb, stride_sr, stride_db, stride_dc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """One ``[BLOCK_R, BLOCK_C]`` tile of batch ``program_id(2)``."""
    b = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r < R)[:, None] & (c < C)[None, :]
    tile = tl.load(src_ptr + b * stride_sb + r.to(tl.int64)[:, None] * stride_sr + c[None, :], mask=m)
    dst = dst_ptr + b * stride_db + c.to(tl.int64)[:, None] * stride_dc + r[None, :]
    tl.store(dst, tl.trans(tile), mask=tl.trans(m))


def transpose_last_two(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Write ``src.transpose(1, 2)`` into ``dst`` and return ``dst``.

    :param src: ``[B, R, C]``, ``src.stride(2) == 1``.
    :param dst: ``[B, C, R]`` of ``src``'s dtype and device, ``dst.stride(2) == 1`` (rows may be padded).
    Runs on the current stream (or on CPU tensors under ``TRITON_INTERPRET=1``).
    """
    B, R, C = src.shape
    if tuple(dst.shape) != (B, C, R) or dst.dtype != src.dtype or src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError(
            f"kimi_core/kernels/transpose: cannot write src {tuple(src.shape)} {src.dtype} "
            f"strides {src.stride()} transposed into dst {tuple(dst.shape)} {dst.dtype} strides "
            f"{dst.stride()}"
        )
    if src.numel() == 0:
        return dst
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C), B)
    transpose_kernel[grid](
        src,
        dst,
        R,
        C,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C,
        num_warps=4,
    )
    return dst
