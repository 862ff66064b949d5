"""MXFP4 ``mxfp4-pack-quantized`` format (compressed-tensors), used for Kimi K3/K3.1 routed experts.

On disk, per expert linear ``[N, K]`` (out, in):

* ``weight_packed`` uint8 ``[N, K/2]``: two E2M1 codes per byte, element ``2k`` in the **low**
  nibble; a code is a sign bit (bit 3) and a 3-bit index into ``0, .5, 1, 1.5, 2, 3, 4, 6``;
* ``weight_scale`` uint8 ``[N, K/32]``: E8M0 exponent, scale ``= 2^(s - 127)``.

Layout from ``vllm-project/compressed-tensors:src/compressed_tensors/compressors/{nvfp4,mxfp4}``.
Quantization follows compressed-tensors / llm-compressor: the group amax is rounded to a power
of two (rounding up when its bf16 mantissa is >= 1.75), the scale exponent is that power minus 2
(``floor(log2 6)``), values are divided by the scale, clamped to +-6 and rounded to the nearest
E2M1 value with ties to the even code.
"""

from __future__ import annotations

import torch

from kimi_core.quant.common import FormatError, check_grouped, group_view, ungroup
from kimi_core.quant.formats import MXFP4

FORMAT = MXFP4.name
GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision boundaries between consecutive magnitudes; a value exactly on a boundary goes to the
# even index (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0).
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])


def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 code values, index = 4-bit code (sign bit 3)."""
    t = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([t, -t])


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., N, K]`` (uint8 in 0..15) into uint8 ``[..., N, K/2]``, even element low."""
    if codes.shape[-1] % 2:
        raise FormatError(f"MXFP4 pack: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., N, K/2]`` -> 4-bit codes uint8 ``[..., N, K]``."""
    if packed.dtype != torch.uint8:
        raise FormatError(f"MXFP4 weight_packed must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def scale_values(weight_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 scales ``2^(s-127)`` (exact)."""
    if weight_scale.dtype != torch.uint8:
        raise FormatError(f"MXFP4 weight_scale must be uint8 E8M0, got {weight_scale.dtype}")
    return torch.ldexp(torch.ones_like(weight_scale, dtype=torch.float32), weight_scale.to(torch.int32) - 127)


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Exact dequantization ``[..., N, K]``: E2M1 value times a power of two, cast to ``dtype``."""
    codes = unpack(weight_packed)
    check_grouped("MXFP4 weight_scale", codes, weight_scale, GROUP)
    vals = e2m1_table(codes.device)[codes.long()]
    return ungroup(group_view(vals, GROUP) * scale_values(weight_scale).unsqueeze(-1)).to(dtype)


def _round_pow2_bf16(amax_bf16: torch.Tensor) -> torch.Tensor:
    """Exponent of amax rounded to a power of two as compressed-tensors does on bf16 bits."""
    bits = amax_bf16.view(torch.int16).to(torch.int32) & 0xFFFF
    bumped = (bits + (1 << 5)) & 0xFF80  # add half of the top mantissa bit's weight, keep sign+exponent
    return (bumped >> 7) - 127  # unbiased exponent (amax >= 0, sign bit clear)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8, 0..15) of ``x`` already divided by its scale and clamped to +-6."""
    a = x.abs().float()
    b = _BOUNDS.to(a.device)
    up = _TIE_GOES_UP.to(a.device)
    # index = number of boundaries strictly below a, plus boundaries equal to a that round up
    idx = (a.unsqueeze(-1) > b).sum(-1) + ((a.unsqueeze(-1) == b) & up).sum(-1)
    sign = torch.signbit(x).to(torch.int64) << 3
    return (idx + sign).to(torch.uint8)


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize ``[..., N, K]`` to ``weight_packed`` uint8 ``[..., N, K/2]`` and ``weight_scale`` uint8 ``[..., N, K/32]``."""
    g = group_view(w.to(torch.bfloat16), GROUP, what="MXFP4 quantize")
    amax = g.abs().amax(-1)
    e = _round_pow2_bf16(amax) - 2
    zero = amax == 0
    s_byte = torch.where(zero, torch.zeros_like(e), (e + 127).clamp(0, 254)).to(torch.uint8)
    scale = scale_values(s_byte)
    y = (g.float() / scale.unsqueeze(-1)).clamp(-6.0, 6.0)
    codes = encode_e2m1(y)
    return {"weight_packed": pack(ungroup(codes)), "weight_scale": s_byte}


def fake_quant_value(w: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w``'s dtype (the served MXFP4 grid)."""
    t = quantize(w)
    return dequantize(t["weight_packed"], t["weight_scale"], w.dtype)
