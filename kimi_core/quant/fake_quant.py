"""Straight-through fake quantization for BF16 master weights (QAT).

Forward returns the served 4-bit grid (``dequantize(quantize(w))``, bit-exact with the on-disk
formats); backward passes the gradient to the master unchanged (straight-through estimator),
as NovaSky-AI/SkyRL's ``fake_int4_qat`` does for the grouped expert GEMMs.
"""

from __future__ import annotations

import torch

from kimi_core.quant import int4, mxfp4


class _FakeInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, scale_divisor: float, q_min: int):
        return int4.fake_quant_value(w, scale_divisor, q_min).to(w.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None, None


class _FakeMxfp4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor):
        return mxfp4.fake_quant_value(w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g


def fake_int4(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Fake-INT4 of ``w`` ``[..., N, K]`` (group 32 along K) with a straight-through backward.

    :param scale_divisor: 7.0 (Kimi QAT convention) or 7.5 (RTN).
    :param q_min: -7 (Kimi) or -8 (RTN).
    """
    return _FakeInt4.apply(w, scale_divisor, q_min)


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Fake-MXFP4 of ``w`` ``[..., N, K]`` (group 32 along K) with a straight-through backward."""
    return _FakeMxfp4.apply(w)
