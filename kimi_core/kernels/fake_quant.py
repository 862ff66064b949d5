"""Straight-through fake quantization of master weights (QAT) to a 4-bit expert format, on any device.

CUDA tensors run the Triton kernels of :mod:`kimi_core.kernels.fake_quant_triton`; others their naive twins
:func:`kimi_core.quant.fake_int4` / :func:`kimi_core.quant.fake_mxfp4`, bit for bit the same values. The gradient
passes straight through to ``w``.
"""

from __future__ import annotations

import torch

from kimi_core.quant.formats import INT4, MXFP4, WeightFormat, weight_format

__all__ = ["fake_int4_gpu", "fake_mxfp4_gpu", "fake_quant_gpu"]


def fake_int4_gpu(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Fake INT4 of ``w`` ``[..., K]`` (groups of 32), in ``w``'s dtype: ``scale_divisor`` 7.0 and ``q_min`` -7 (the
    Kimi QAT convention) or 7.5 / -8 (RTN)."""
    if w.is_cuda:
        from kimi_core.kernels.fake_quant_triton import fake_int4_triton

        return fake_int4_triton(w, scale_divisor, q_min)
    from kimi_core.quant import fake_int4

    return fake_int4(w, scale_divisor, q_min)


def fake_mxfp4_gpu(w: torch.Tensor) -> torch.Tensor:
    """Fake MXFP4 of ``w`` ``[..., K]`` (groups of 32), in ``w``'s dtype."""
    if w.is_cuda:
        from kimi_core.kernels.fake_quant_triton import fake_mxfp4_triton

        return fake_mxfp4_triton(w)
    from kimi_core.quant import fake_mxfp4

    return fake_mxfp4(w)


def fake_quant_gpu(
    w: torch.Tensor, fmt: str | WeightFormat, scale_divisor: float = 7.0, q_min: int = -7
) -> torch.Tensor:
    """Fake quantization of ``w`` ``[..., K]`` to ``fmt`` (a format object or its config string;
    ``scale_divisor`` / ``q_min`` apply to INT4 only)."""
    try:
        wf = weight_format(fmt)
    except ValueError:
        raise ValueError(
            f"kimi_core/kernels/fake_quant: fmt must be {MXFP4.name!r} or {INT4.name!r}, got {fmt!r}"
        ) from None
    if wf is MXFP4:
        return fake_mxfp4_gpu(w)
    return fake_int4_gpu(w, scale_divisor, q_min)
