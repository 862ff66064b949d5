"""Fixed-point checks: does re-quantizing a dequantized tensor give back the same bytes?

A Kimi-convention INT4 checkpoint (scale = amax/7, q in [-7, 7]) is its own fixed point, so its
dequantized BF16 weights can serve as QAT masters that fake-quantize back to the served grid bit
for bit. An RTN checkpoint (amax/7.5, q in [-8, 7]) is not; its masters must be the original
BF16 weights. MXFP4 checkpoints written by llm-compressor-style quantizers are fixed points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_core.quant import int4, mxfp4


@dataclass
class FixedPointReport:
    """Mismatch counts of one tensor: scales and codes that re-quantization changed."""

    bad_scales: int
    bad_codes: int
    total_groups: int

    @property
    def ok(self) -> bool:
        return self.bad_scales == 0 and self.bad_codes == 0


def check_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    scale_divisor: float = 7.0,
    q_min: int = -7,
    dequantized: torch.Tensor | None = None,
) -> FixedPointReport:
    """Re-quantize the bf16 dequantization of an INT4 tensor and count changed scales and codes.

    :param dequantized: the bf16 dequantization if the caller already has it (saves recomputing it).
    """
    w = int4.dequantize(weight_packed, weight_scale, torch.bfloat16) if dequantized is None else dequantized
    q_new, s_new = int4.quantize_codes(w, scale_divisor, q_min)
    q_old = int4.unpack(weight_packed)
    return FixedPointReport(int((s_new != weight_scale).sum()), int((q_new != q_old).sum()), weight_scale.numel())


def check_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dequantized: torch.Tensor | None = None
) -> FixedPointReport:
    """Re-quantize the bf16 dequantization of an MXFP4 tensor and count changed scales and codes.

    Codes are compared by value (``+0`` and ``-0`` are the same weight), scales bytewise, except
    that all-zero groups carry no scale information.

    :param dequantized: the bf16 dequantization if the caller already has it (saves recomputing it).
    """
    w = mxfp4.dequantize(weight_packed, weight_scale, torch.bfloat16) if dequantized is None else dequantized
    t = mxfp4.quantize(w)
    # scales are powers of two, so a group of w is all zero exactly when all its codes are +-0
    zero_group = w.reshape(*weight_scale.shape, -1).abs().amax(-1) == 0
    bad_s = ((t["weight_scale"] != weight_scale) & ~zero_group).sum()
    bad_q = (w != mxfp4.dequantize(t["weight_packed"], t["weight_scale"], torch.bfloat16)).sum()
    return FixedPointReport(int(bad_s), int(bad_q), weight_scale.numel())
