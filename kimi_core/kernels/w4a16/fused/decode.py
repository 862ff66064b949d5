"""Decoding 4-bit weights to bf16 inside the fused Triton W4A16 kernels, all exact: bit for bit the values of
:func:`kimi_core.quant.dequantize`.

* MXFP4: the 3 magnitude bits of an E2M1 code placed at bf16 bits 6..8 (exponent low bits and top mantissa bit) and
  the sign at bit 15 give ``value * 2^-126`` (codes 1 and 9 land on bf16 subnormals, which the bf16 multiply keeps);
  one multiply by ``2^126`` and one by the E8M0 scale (a bf16 power of two, ``bits = s << 7``) give the weight.
  ``FMT_MXFP4_FOLDED`` (:mod:`..format_ids`): one multiply by ``2^(s - 1)``, the same product rounded once.
* INT4: ``0x4300 | nibble`` is the bf16 number ``128 + nibble``; subtracting 136 gives the code ``q`` exactly, and
  one bf16 multiply by the group scale rounds ``q * scale`` once, as the naive twin's fp32 product cast to bf16 does.

:func:`decode_words` decodes whole int32 words (8 codes each) with inline PTX on the GPU and a portable twin in the
interpreter; :func:`load_weight_tile` loads and decodes a tile element by element (any ``K``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_value(nib, FMT: tl.constexpr):
    """4-bit codes (int tensor, 0..15) -> their unscaled fp32 values: E2M1 (MXFP4) or ``nib - 8`` (INT4).

    Portable fp32 arithmetic (no subnormals), used by the interpreter and the generic kernels.
    """
    if FMT == 0:
        mag = nib & 0x7
        ex = mag >> 1
        normal = ((ex + 126) << 23) | ((mag & 1) << 22)  # (1 + m/2) * 2^(ex - 1)
        v = tl.where(ex == 0, (mag & 1).to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
        return tl.where((nib & 0x8) != 0, -v, v)
    else:
        return (nib - 8).to(tl.float32)


@triton.jit
def scale_value(s, FMT: tl.constexpr):
    """Group scales as fp32: E8M0 bytes ``2^(s - 127)`` (MXFP4) or the bf16 scale (INT4)."""
    if FMT == 0:
        si = s.to(tl.int32) & 0xFF
        return tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)
    else:
        return s.to(tl.float32)


@triton.jit
def scale_bf16(s, FMT: tl.constexpr):
    """Group scales as the bf16 factor of the word decoders: an E8M0 byte ``s`` becomes the bf16 with bits
    ``s << 7`` (``2^(s - 127)``; ``s = 0`` the subnormal ``2^-127``, bits ``0x40``); :data:`FMT_MXFP4_FOLDED`: ``2^(s
    - 1)``, the decoders' ``2^126`` folded in; INT4 scales are bf16 already."""
    if FMT == 0:
        sb = s.to(tl.uint16)
        return tl.where(sb == 0, 0x40, sb << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif FMT == 2:  # FMT_MXFP4_FOLDED: 2^(s - 1), bits (s + 126) << 7, a normal bf16 for every s <= 128
        return ((s.to(tl.uint16) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return s


@triton.jit
def mxfp4_decode(b, s):
    """uint8 codes ``[R, C]`` (two E2M1 per byte) and E8M0 bytes ``[R, C // 16]`` -> bf16 ``[R, 2C]``."""
    R: tl.constexpr = b.shape[0]
    C: tl.constexpr = b.shape[1]
    bi = b.to(tl.int32) & 0xFF
    w = tl.join(code_value(bi & 0xF, 0), code_value(bi >> 4, 0))  # element 2j: low nibble
    w = w.reshape(R, C // 16, 32) * scale_value(s, 0)[:, :, None]
    return w.reshape(R, 2 * C).to(tl.bfloat16)


@triton.jit
def int4_decode(words, s):
    """int32 words ``[R, C]`` (eight offset-binary nibbles each) and bf16 scales ``[R, C // 4]`` -> bf16 ``[R, 8C]``."""
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    shifts = tl.arange(0, 8) * 4
    nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # element 8m + j in nibble j
    v = code_value(nib, 1).reshape(R, C // 4, 32) * scale_value(s, 1)[:, :, None]
    return v.reshape(R, 8 * C).to(tl.bfloat16)


@triton.jit
def load_weight_tile(
    wq_ptr,
    ws_ptr,
    rows_w,
    row_mask_w,
    k0,
    K,
    stride_wn,
    stride_sn,
    FMT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERP: tl.constexpr = False,
):
    """Decoded bf16 tile ``W[rows_w, k0 : k0 + BLOCK_C]`` -> ``[BLOCK_R, BLOCK_C]`` (one expert's base pointers)."""
    G: tl.constexpr = BLOCK_C // 32
    g = k0 // 32 + tl.arange(0, G)
    s_ptrs = ws_ptr + rows_w[:, None] * stride_sn + g[None, :]
    if FMT == 0:
        P: tl.constexpr = BLOCK_C // 2
        j = k0 // 2 + tl.arange(0, P)
        q_ptrs = wq_ptr + rows_w[:, None] * stride_wn + j[None, :]
        if EVEN_K:
            q = tl.load(q_ptrs, mask=row_mask_w[:, None], other=0)
            s = tl.load(s_ptrs, mask=row_mask_w[:, None], other=127)
        else:
            q = tl.load(q_ptrs, mask=row_mask_w[:, None] & (j < K // 2)[None, :], other=0)
            s = tl.load(s_ptrs, mask=row_mask_w[:, None] & (g < K // 32)[None, :], other=127)
        return mxfp4_decode(q, s)
    else:
        P8: tl.constexpr = BLOCK_C // 8
        j = k0 // 8 + tl.arange(0, P8)
        q_ptrs = wq_ptr + rows_w[:, None] * stride_wn + j[None, :]
        if EVEN_K:
            q = tl.load(q_ptrs, mask=row_mask_w[:, None], other=0x88888888)
            s = tl.load(s_ptrs, mask=row_mask_w[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=row_mask_w[:, None] & (j < K // 8)[None, :], other=0x88888888)
            s = tl.load(s_ptrs, mask=row_mask_w[:, None] & (g < K // 32)[None, :], other=0.0)
        return int4_decode(q, s)


# --- word decoders: one int32 word = 8 consecutive 4-bit codes (elements 8m + e, e = 0..7) ---
# The fast forward path decodes whole words into bf16 pairs (element e, element e + 4), the pairs
# the classic nibble masks 0x000F000F give for free, and permutes the reduction axis so that each
# thread's MMA operand registers are exactly such pairs (see ``_fwd_perm_tile``).


def _mxfp4_word_asm(folded: bool) -> str:
    """PTX decoding one int32 word of 8 E2M1 codes into 8 bf16 (``$0``-``$7``, element ``e`` and ``e + 4`` from one
    bf16x2), scale ``$9``: each pair's codes placed as bf16 bits ``s << 15 | eem << 6`` (the value times
    ``2^-126``), then one multiply by ``2^126`` and one by the scale ``2^(s - 127)``; ``folded``: one multiply by the
    scale ``2^(s - 1)`` (:data:`FMT_MXFP4_FOLDED`), the same exact product rounded once."""
    lines = ["{", ".reg .b32 s2, v, r;" if folded else ".reg .b32 s2, c126, v, r;", "mov.b32 s2, {$9, $9};"]
    lines += [] if folded else ["mov.b32 c126, 0x7E807E80;"]
    for e in range(4):
        lines += [f"shr.u32 v, $8, {4 * e};", "and.b32 v, v, 0x000F000F;"] if e else ["and.b32 v, $8, 0x000F000F;"]
        lines += ["mul.lo.u32 v, v, 0x1040;", "and.b32 r, v, 0x81C081C0;"]
        lines += ([] if folded else ["mul.rn.bf16x2 r, r, c126;"]) + ["mul.rn.bf16x2 r, r, s2;"]
        lines += [f"mov.b32 {{${e}, ${e + 4}}}, r;"]
    return "\n".join(lines + ["}"]) + "\n"


_MXFP4_WORD_ASM = tl.constexpr(_mxfp4_word_asm(False))
_MXFP4_FOLDED_WORD_ASM = tl.constexpr(_mxfp4_word_asm(True))

_INT4_WORD_ASM = tl.constexpr("""
{
.reg .b32 s2, one, m136, r;
mov.b32 s2, {$9, $9};
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
lop3.b32 r, $8, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 r, r, one, m136;
mul.rn.bf16x2 r, r, s2;
mov.b32 {$0, $4}, r;
shr.u32 r, $8, 4;
lop3.b32 r, r, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 r, r, one, m136;
mul.rn.bf16x2 r, r, s2;
mov.b32 {$1, $5}, r;
shr.u32 r, $8, 8;
lop3.b32 r, r, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 r, r, one, m136;
mul.rn.bf16x2 r, r, s2;
mov.b32 {$2, $6}, r;
shr.u32 r, $8, 12;
lop3.b32 r, r, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 r, r, one, m136;
mul.rn.bf16x2 r, r, s2;
mov.b32 {$3, $7}, r;
}
""")


@triton.jit
def _word_elem(words, scale, e: tl.constexpr, FMT: tl.constexpr):
    """Element ``e`` (nibble ``e``) of each int32 word times its bf16 scale -> bf16 (portable twin of the asm;
    :data:`FMT_MXFP4_FOLDED`'s ``2^(s - 1)`` is taken back to ``2^(s - 127)`` exactly, fp32 keeps ``2^-127``)."""
    nib = (words >> (4 * e)) & 0xF
    if FMT == 2:
        v = code_value(nib, 0) * (scale.to(tl.float32) * 1.1754943508222875e-38)  # 2^-126
    else:
        v = code_value(nib, FMT) * scale.to(tl.float32)
    return v.to(tl.bfloat16)


@triton.jit
def decode_words(words, scale, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 words and their bf16 scales (same shape) -> the 8 decoded elements, 8 bf16 tensors."""
    if USE_ASM:
        if FMT == 0:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _MXFP4_WORD_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                [words, scale],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        elif FMT == 2:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _MXFP4_FOLDED_WORD_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                [words, scale],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _INT4_WORD_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                [words, scale],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
    else:
        o0 = _word_elem(words, scale, 0, FMT)
        o1 = _word_elem(words, scale, 1, FMT)
        o2 = _word_elem(words, scale, 2, FMT)
        o3 = _word_elem(words, scale, 3, FMT)
        o4 = _word_elem(words, scale, 4, FMT)
        o5 = _word_elem(words, scale, 5, FMT)
        o6 = _word_elem(words, scale, 6, FMT)
        o7 = _word_elem(words, scale, 7, FMT)
    return o0, o1, o2, o3, o4, o5, o6, o7
