"""Triton fake quantization of BF16 master weights (QAT), bit-exact with :mod:`kimi_core.quant`.

``fake_int4_triton(w, scale_divisor, q_min)`` and ``fake_mxfp4_triton(w)`` (CUDA tensors; the public ops that pick
them are in :mod:`kimi_core.kernels.fake_quant`) return the served 4-bit grid
(``dequantize(quantize(w))``) for ``w`` ``[..., K]`` with groups of 32 along the last axis, with a
straight-through backward. Their CPU twins are :func:`kimi_core.quant.fake_int4` and
:func:`kimi_core.quant.fake_mxfp4`; each step below repeats the reference's arithmetic, roundings
included:

* INT4: ``scale = bf16(fp32(amax) / divisor)`` (IEEE division), ``q = rint(bf16(w / scale))``
  clamped to ``[q_min, 7]`` (the reference divides in bf16, i.e. an fp32 division rounded to bf16),
  zero scale gives zero codes, output ``bf16(q * scale)``.
* MXFP4: the bf16 amax rounded to a power of two on its bits, scale byte ``clamp(e + 127, 0, 254)``
  (0 for all-zero groups), ``y = clamp(w / scale, -6, 6)`` in fp32, nearest E2M1 magnitude with
  ties to the even code, output ``value * scale`` in ``w``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rint(x):
    """Round half to even for ``|x| < 2^22`` (fp32 add and subtract of 1.5 * 2^23)."""
    big = 12582912.0
    return (x + big) - big


@triton.jit
def _fake_int4_kernel(w_ptr, out_ptr, num_groups, scale_divisor, q_min, BLOCK_G: tl.constexpr):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    gm = g < num_groups
    offs = g.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]
    w = tl.load(w_ptr + offs, mask=gm[:, None], other=0.0).to(tl.bfloat16).to(tl.float32)  # [BG, 32]
    amax = tl.max(tl.abs(w), axis=1)  # exact (bf16 values)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 1.0, tl.float32) * scale_divisor)
    scale = scale.to(tl.bfloat16).to(tl.float32)
    safe = tl.where(scale == 0.0, 1.0, scale)
    t = tl.math.div_rn(w, tl.broadcast_to(safe[:, None], w.shape)).to(tl.bfloat16).to(tl.float32)
    q = _rint(t)
    q = tl.where(scale[:, None] == 0.0, 0.0, q)
    q = tl.minimum(tl.maximum(q, q_min.to(tl.float32)), 7.0)
    v = (q * scale[:, None]).to(tl.bfloat16)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=gm[:, None])


@triton.jit
def _fake_mxfp4_kernel(w_ptr, out_ptr, num_groups, BLOCK_G: tl.constexpr):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    gm = g < num_groups
    offs = g.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]
    wb = tl.load(w_ptr + offs, mask=gm[:, None], other=0.0).to(tl.bfloat16)  # [BG, 32]
    w = wb.to(tl.float32)
    amax = tl.max(tl.abs(w), axis=1)  # a bf16 value, exactly
    bits = (amax.to(tl.int32, bitcast=True) >> 16) & 0xFFFF  # its bf16 bit pattern
    e = (((bits + 32) & 0xFF80) >> 7) - 127 - 2
    s = tl.where(amax == 0.0, 0, tl.minimum(tl.maximum(e + 127, 0), 254))  # E8M0 byte
    scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
    y = tl.math.div_rn(w, tl.broadcast_to(scale[:, None], w.shape))
    y = tl.minimum(tl.maximum(y, -6.0), 6.0)
    a = tl.abs(y)
    # nearest of 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code (bounds .75, 1.75, 3.5 round up)
    mag = tl.where(a < 0.25, 0.0, tl.where(a < 0.75, 0.5, 1.0))
    mag = tl.where(a == 0.25, 0.0, mag)
    mag = tl.where(a >= 0.75, 1.0, mag)
    mag = tl.where(a > 1.25, 1.5, mag)
    mag = tl.where(a >= 1.75, 2.0, mag)
    mag = tl.where(a > 2.5, 3.0, mag)
    mag = tl.where(a >= 3.5, 4.0, mag)
    mag = tl.where(a > 5.0, 6.0, mag)
    # copy y's sign bit onto the magnitude (``-mag`` would lower to ``0 - mag`` and lose -0)
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31
    v = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * scale[:, None]
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=gm[:, None])


_BLOCK_G = 64


def _launch_shape(w: torch.Tensor):
    if w.shape[-1] % 32:
        raise ValueError(f"kimi_core/kernels/fake_quant_triton.py: w last dim {w.shape[-1]} is not a multiple of 32")
    return w.numel() // 32


def fake_int4_value(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Forward only: the INT4 grid of ``w`` ``[..., K]`` in ``w``'s dtype (twin of
    ``int4.fake_quant_value(w).to(w.dtype)``)."""
    wc = w.contiguous()
    out = torch.empty_like(wc)
    groups = _launch_shape(wc)
    if groups:
        _fake_int4_kernel[(triton.cdiv(groups, _BLOCK_G),)](
            wc, out, groups, float(scale_divisor), int(q_min), BLOCK_G=_BLOCK_G, num_warps=4
        )
    return out


def fake_mxfp4_value(w: torch.Tensor) -> torch.Tensor:
    """Forward only: the MXFP4 grid of ``w`` ``[..., K]`` in ``w``'s dtype (twin of ``mxfp4.fake_quant_value``)."""
    wc = w.contiguous()
    out = torch.empty_like(wc)
    groups = _launch_shape(wc)
    if groups:
        _fake_mxfp4_kernel[(triton.cdiv(groups, _BLOCK_G),)](wc, out, groups, BLOCK_G=_BLOCK_G, num_warps=4)
    return out


class _FakeInt4GPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale_divisor, q_min):
        return fake_int4_value(w, scale_divisor, q_min)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _FakeMxfp4GPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return fake_mxfp4_value(w)

    @staticmethod
    def backward(ctx, g):
        return g


def fake_int4_triton(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Fake-INT4 of ``w`` ``[..., K]`` on the GPU with a straight-through backward.

    :param scale_divisor: 7.0 (Kimi QAT convention) or 7.5 (RTN); :param q_min: -7 (Kimi) or -8 (RTN).
    """
    return _FakeInt4GPU.apply(w, scale_divisor, q_min)


def fake_mxfp4_triton(w: torch.Tensor) -> torch.Tensor:
    """Fake-MXFP4 of ``w`` ``[..., K]`` on the GPU with a straight-through backward."""
    return _FakeMxfp4GPU.apply(w)
