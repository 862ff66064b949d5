"""INT4 ``pack-quantized`` format (compressed-tensors), used for Kimi K2.x routed experts.

On disk, per expert linear ``[N, K]`` (out, in):

* ``weight_packed`` int32 ``[N, K/8]``: 8 codes per word, element ``8m + j`` in nibble ``j``
  (bits ``4j..4j+3``) of word ``m``, each stored as ``q + 8`` (offset binary);
* ``weight_scale`` bf16 ``[N, K/32]``: one symmetric scale per group of 32 input columns;
* ``weight_shape`` int ``[2]``: ``(N, K)``.

Dequantized value: ``(nibble - 8) * scale``. Layout facts from
``vllm-project/compressed-tensors:src/compressed_tensors/compressors/pack_quantized``.

Two quantization conventions (NovaSky-AI/SkyRL:
``skyrl/backends/skyrl_train/workers/megatron/fake_int4_qat.py``):

* Kimi QAT (K2-Thinking, K2.5-K2.7): ``scale = bf16(amax / 7.0)``, ``q`` in ``[-7, 7]``. The
  dequantized masters are a fixed point of re-quantization.
* llm-compressor RTN: ``scale = bf16(amax / 7.5)``, ``q`` in ``[-8, 7]``. Not a fixed point.

``q = clamp(round_half_even(w / scale), q_min, 7)`` with divide and round in bf16; all-zero
groups give scale 0 and codes 0 (guarded divide, no eps clamp).
"""

from __future__ import annotations

import torch

from kimi_core.quant.common import FormatError, check_grouped, group_view, ungroup
from kimi_core.quant.formats import INT4

FORMAT = INT4.name
GROUP = 32
KIMI_CONVENTION = (7.0, -7)
RTN_CONVENTION = (7.5, -8)
CONVENTIONS = {"kimi": KIMI_CONVENTION, "rtn": RTN_CONVENTION}

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j at bits 4j


def pack(q: torch.Tensor) -> torch.Tensor:
    """Pack signed codes ``[..., N, K]`` (ints in ``[-8, 7]``) into int32 ``[..., N, K/8]``."""
    if q.shape[-1] % 8:
        raise FormatError(f"INT4 pack: last dim {q.shape[-1]} is not a multiple of 8")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise FormatError(f"INT4 pack: codes must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    u = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    words = (u << _SHIFTS.to(q.device, torch.int64)).sum(-1)
    # two's-complement wrap into int32 (bit 31 set when the top nibble is >= 8)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 ``[..., N, K/8]`` into signed int8 codes ``[..., N, K]`` (``nibble - 8``)."""
    if packed.dtype != torch.int32:
        raise FormatError(f"INT4 weight_packed must be int32, got {packed.dtype}")
    nib = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return (nib.to(torch.int8) - 8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Exact dequantization ``[..., N, K]`` = ``q * scale`` in fp32, then cast to ``dtype``.

    The fp32 product of a 4-bit code and a bf16 scale is exact, so the bf16 result equals
    compressed-tensors' ``bf16(q) * scale`` bit for bit.
    """
    q = unpack(weight_packed)
    check_grouped("INT4 weight_scale", q, weight_scale, GROUP)
    w = group_view(q.to(torch.float32), GROUP) * weight_scale.to(torch.float32).unsqueeze(-1)
    return ungroup(w).to(dtype)


def quantize_codes(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``w`` ``[..., N, K]`` under a convention (see module docstring).

    :returns: ``(q int8 [..., N, K], scale bf16 [..., N, K/32])``
    """
    g = group_view(w.to(torch.bfloat16), GROUP, what="INT4 quantize")
    amax = g.abs().amax(-1)  # exact in bf16
    scale = (amax.to(torch.float32) / scale_divisor).to(torch.bfloat16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / safe.unsqueeze(-1))  # bf16 divide, round half to even
    q = torch.where(scale.unsqueeze(-1) == 0, torch.zeros_like(q), q)
    q = q.clamp(q_min, 7).to(torch.int8)
    return ungroup(q), scale


def quantize(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> dict[str, torch.Tensor]:
    """Quantize ``[..., N, K]`` to on-disk tensors ``weight_packed``, ``weight_scale``, ``weight_shape``."""
    q, scale = quantize_codes(w, scale_divisor, q_min)
    return {
        "weight_packed": pack(q),
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(w.shape[-2:]), dtype=torch.int64),
    }


def fake_quant_value(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """``dequantize(quantize(w))`` in bf16 (the served grid), same shape as ``w``."""
    q, scale = quantize_codes(w, scale_divisor, q_min)
    return (group_view(q.to(torch.bfloat16), GROUP) * scale.unsqueeze(-1)).flatten(-2)
