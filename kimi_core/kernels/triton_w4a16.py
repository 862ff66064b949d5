"""Triton W4A16 grouped GEMM: bf16 activations times 4-bit experts, dequantized in registers.

Forward ``y[T, N] = x[T, K] . dequant(W_e)[N, K]^T`` and dgrad ``dx[T, K] = dy[T, N] . dequant(W_e)``
for the rows of each expert ``e``, with the weights in their on-disk layouts (see
:mod:`kimi_core.quant.mxfp4` and :mod:`kimi_core.quant.int4`). The packed weight tile is loaded,
decoded to bf16 in registers and fed to the tensor cores; no bf16 copy of a weight ever reaches HBM.
Accumulation is fp32. The pure-torch twin with the same semantics is
:mod:`kimi_core.kernels.reference`.

Both kernels compute the transposed product (``acc[BLOCK_N, BLOCK_M] = W_tile . x_tile^T``), so
the weight tile, which is decoded in registers anyway, is the MMA's left operand and the token
count only sets the MMA's narrow side: 8 tokens per expert waste no more than a 16-wide tile.

Decoding (all exact, bit for bit the values of ``kimi_core.quant``'s ``dequantize``):

* MXFP4: the 3 magnitude bits of an E2M1 code placed at bf16 bits 6..8 (exponent low bits and top
  mantissa bit) and the sign at bit 15 give ``value * 2^-126`` (codes 1 and 9 land on bf16
  subnormals, which the bf16 multiply keeps); one multiply by ``2^126`` and one by the E8M0 scale
  (a bf16 power of two, ``bits = s << 7``) give the weight.
* INT4: ``0x4300 | nibble`` is the bf16 number ``128 + nibble``; subtracting 136 gives the code
  ``q`` exactly, and one bf16 multiply by the group scale rounds ``q * scale`` once, as the
  reference's fp32 product cast to bf16 does.

Rows are sorted by expert; ``offsets`` int32 ``[E + 1]`` holds each expert's first row. Each
program finds its (expert, row tile, column tile) from ``offsets`` with one vector load and a
prefix sum, so neither the launcher nor the kernel needs the host to know the split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_core.kernels.gluon_w4a16 import FMT_MXFP4_FOLDED, kernel_fmt_id

FMT_MXFP4 = 0
FMT_INT4 = 1
# FMT_MXFP4_FOLDED (2, from gluon_w4a16; the permuted kernels only): MXFP4 whose E8M0 bytes are all <= 128, decoded
# with one multiply


@triton.jit
def _expert_row_tiles(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """``(ev, lo, hi, ntiles)``: expert indices ``[E_POW2]`` (past ``E``: empty), each expert's first and end row,
    and its row tiles of ``BLOCK_M``."""
    ev = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + ev, mask=ev < E, other=0)
    hi = tl.load(offsets_ptr + ev + 1, mask=ev < E, other=0)
    return ev, lo, hi, (hi - lo + BLOCK_M - 1) // BLOCK_M


@triton.jit
def _schedule(pid, offsets_ptr, E, num_cols, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr,
              GROUP_M: tl.constexpr):
    """Map a program id to ``(valid, expert, col_block, rows, row_mask)``.

    Row tiles of all experts are numbered back to back; ``GROUP_M`` consecutive row tiles share a
    sweep over the column blocks so that their weight tiles and activation tiles meet in L2.
    """
    ev, lo, hi, ntiles = _expert_row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)
    cum = tl.cumsum(ntiles, 0)  # inclusive prefix sum
    total = tl.sum(ntiles, 0)
    per_group = GROUP_M * num_cols
    group = pid // per_group
    first = group * GROUP_M
    gsize = tl.maximum(tl.minimum(total - first, GROUP_M), 1)
    tile = first + (pid % per_group) % gsize
    col = (pid % per_group) // gsize
    valid = (tile < total) & (col < num_cols)
    expert = tl.sum((cum <= tile).to(tl.int32), 0)
    sel = ev == expert
    tile0 = tl.sum(tl.where(sel, cum - ntiles, 0), 0)
    row0 = tl.sum(tl.where(sel, lo, 0), 0)
    row_end = tl.sum(tl.where(sel, hi, 0), 0)
    rows = row0 + (tile - tile0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return valid, expert, col, rows, rows < row_end


@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    """``acc + a . b``; the interpreter multiplies bf16 arrays wrongly, so it gets fp32 operands."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _code_value(nib, FMT: tl.constexpr):
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
def _scale_value(s, FMT: tl.constexpr):
    """Group scales as fp32: E8M0 bytes ``2^(s - 127)`` (MXFP4) or the bf16 scale (INT4)."""
    if FMT == 0:
        si = s.to(tl.int32) & 0xFF
        return tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)
    else:
        return s.to(tl.float32)


@triton.jit
def _scale_bf16(s, FMT: tl.constexpr):
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
def _mxfp4_decode(b, s):
    """uint8 codes ``[R, C]`` (two E2M1 per byte) and E8M0 bytes ``[R, C // 16]`` -> bf16 ``[R, 2C]``."""
    R: tl.constexpr = b.shape[0]
    C: tl.constexpr = b.shape[1]
    bi = b.to(tl.int32) & 0xFF
    w = tl.join(_code_value(bi & 0xF, 0), _code_value(bi >> 4, 0))  # element 2j: low nibble
    w = w.reshape(R, C // 16, 32) * _scale_value(s, 0)[:, :, None]
    return w.reshape(R, 2 * C).to(tl.bfloat16)


@triton.jit
def _int4_decode(words, s):
    """int32 words ``[R, C]`` (eight offset-binary nibbles each) and bf16 scales ``[R, C // 4]`` -> bf16 ``[R, 8C]``."""
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    shifts = tl.arange(0, 8) * 4
    nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # element 8m + j in nibble j
    v = _code_value(nib, 1).reshape(R, C // 4, 32) * _scale_value(s, 1)[:, :, None]
    return v.reshape(R, 8 * C).to(tl.bfloat16)


@triton.jit
def _load_weight_tile(wq_ptr, ws_ptr, rows_w, row_mask_w, k0, K, stride_wn, stride_sn,
                      FMT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      EVEN_K: tl.constexpr, INTERP: tl.constexpr = False):
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
        return _mxfp4_decode(q, s)
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
        return _int4_decode(q, s)


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
        lines += ([f"shr.u32 v, $8, {4 * e};", "and.b32 v, v, 0x000F000F;"] if e else ["and.b32 v, $8, 0x000F000F;"])
        lines += ["mul.lo.u32 v, v, 0x1040;", "and.b32 r, v, 0x81C081C0;"]
        lines += ([] if folded else ["mul.rn.bf16x2 r, r, c126;"]) + ["mul.rn.bf16x2 r, r, s2;"]
        lines += [f"mov.b32 {{${e}, ${e + 4}}}, r;"]
    return "\n".join(lines + ["}"]) + "\n"


# the permuted forward's reduction step (one decoded [BN, 128] weight tile) and, with K_PAIRS, a loop iteration's two
# steps: the kernels and the launcher's fwd_steps both read these
FWD_STEP = tl.constexpr(128)
FWD_PAIR_STEP = tl.constexpr(256)

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
        v = _code_value(nib, 0) * (scale.to(tl.float32) * 1.1754943508222875e-38)  # 2^-126
    else:
        v = _code_value(nib, FMT) * scale.to(tl.float32)
    return v.to(tl.bfloat16)


@triton.jit
def _decode_words(words, scale, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 words and their bf16 scales (same shape) -> the 8 decoded elements, 8 bf16 tensors."""
    if USE_ASM:
        if FMT == 0:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _MXFP4_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
        elif FMT == 2:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _MXFP4_FOLDED_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _INT4_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
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


@triton.jit
def _fwd_perm_scales(ws_ptr, offs_n, n_mask, k0, stride_sn, FMT: tl.constexpr, GROUPS: tl.constexpr):
    """Raw scales ``[BN, GROUPS]`` of the 32-wide groups from K column ``k0`` on (E8M0 bytes or bf16 for INT4;
    masked rows: a neutral byte / zero)."""
    ptrs = ws_ptr + offs_n[:, None] * stride_sn + (k0 // 32 + tl.arange(0, GROUPS))[None, :]
    if FMT != 1:  # E8M0 bytes (MXFP4, folded or not)
        return tl.load(ptrs, mask=n_mask[:, None], other=127)
    return tl.load(ptrs, mask=n_mask[:, None], other=0.0)


@triton.jit
def _fwd_perm_decode(q, sb, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """Decoded bf16 weight tile ``[BN, 128]`` of one 128-wide K step in the permuted K order, from the step's int32
    words ``q [BN, 4(t), 4(w)]`` and raw scales ``sb [BN, 4(t)]`` (layout in :func:`_fwd_perm_tile`)."""
    BLOCK_N: tl.constexpr = q.shape[0]
    sb = _scale_bf16(sb, FMT)
    s3 = tl.broadcast_to(sb[:, :, None], (BLOCK_N, 4, 4))
    o0, o1, o2, o3, o4, o5, o6, o7 = _decode_words(q, s3, FMT, USE_ASM)  # each [BN, 4(t), 4(w)]
    p = tl.join(tl.join(tl.join(o0, o4), tl.join(o1, o5)), tl.join(tl.join(o2, o6), tl.join(o3, o7)))
    # p: [BN, t, w, u, j_lo, j_hi] -> [BN, w, j_hi, j_lo, t, u]
    return tl.permute(p, (0, 2, 5, 4, 1, 3)).reshape(BLOCK_N, 128)


@triton.jit
def _fwd_perm_x(x_rows, row_mask, k0):
    """Activation tile ``[BM, 128]`` (bf16) of the 128-wide K step from column ``k0``, in the permuted K order."""
    BLOCK_M: tl.constexpr = x_rows.shape[0]
    offs_k = k0 + tl.arange(0, 128)
    x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None], other=0.0)  # [BM, 128] physical
    # physical [BM, t, w, u, j] -> logical [BM, w, j, t, u]
    return tl.permute(x.reshape(BLOCK_M, 4, 4, 2, 4), (0, 2, 4, 1, 3)).reshape(BLOCK_M, 128)


@triton.jit
def _fwd_perm_tile(wq_ptr, ws_ptr, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn,
                   FMT: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr, ROW_LOADS: tl.constexpr):
    """Decoded weight tile and activation tile of one 128-wide K step, both in the permuted K order.

    Physical column ``c = 32t + 8w + 4u + j`` (``t, w, j < 4``, ``u < 2``) is logical column
    ``L = 32w + 8j + 2t + u``. The MMA gives thread-quad lane ``t`` the logical pairs
    ``(2t + 8i, 2t + 8i + 1)``, which are physical ``(32t + 8w + j, 32t + 8w + j + 4)``: nibbles
    ``j`` and ``j + 4`` of word ``4t + w``. So each thread decodes four whole words of one scale
    group (group ``t``) into exactly its operand registers. Returns ``(w [BN, 128], x [BM, 128])``.

    ``ROW_LOADS``: a row's 16 words of the step are loaded as one contiguous run ``[BN, 16]`` and split into ``[BN,
    4(t), 4(w)]`` after the load, so 4 lanes share a row's 64 bytes and one 16-byte ``cp.async`` instruction covers 8
    rows; loaded as ``[BN, 4, 4]`` the compiler spreads a warp's lanes over 32 rows of 16 bytes each.
    """
    wt = tl.arange(0, 4)
    if ROW_LOADS:
        # the step's 16 words of a row as one contiguous run, so 4 lanes share a row's 64 bytes
        q = tl.load(wq_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + tl.arange(0, 16))[None, :],
                    mask=n_mask[:, None], other=0).reshape(BLOCK_N, 4, 4)  # int32 [BN, 4(t), 4(w)]
    else:
        word = k0 // 8 + wt[:, None] * 4 + tl.arange(0, 4)[None, :]  # [4(t), 4(w)] word index in the row
        q = tl.load(wq_ptr + offs_n[:, None, None] * stride_wn + word[None, :, :],
                    mask=n_mask[:, None, None], other=0)  # int32 [BN, 4, 4]
    sb = _fwd_perm_scales(ws_ptr, offs_n, n_mask, k0, stride_sn, FMT, 4)
    return _fwd_perm_decode(q, sb, FMT, USE_ASM), _fwd_perm_x(x_rows, row_mask, k0)


@triton.jit
def _fwd_perm_pair(wq_ptr, ws_ptr, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn, acc,
                   FMT: tl.constexpr, USE_ASM: tl.constexpr, INTERP: tl.constexpr):
    """``acc [BN, BM]`` plus the products of the two 128-wide K steps from ``k0``, first step first (the same sums
    as two :func:`_fwd_perm_tile` steps). A row's 32 words of both steps are loaded as one 128-byte run ``[BN, 32]``
    and its 8 scales as one ``[BN, 8]``, then split per step."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    q = tl.load(wq_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + tl.arange(0, 32))[None, :],
                mask=n_mask[:, None], other=0)  # int32 [BN, 32]: both steps' words of a row
    q0, q1 = tl.split(tl.permute(q.reshape(BLOCK_N, 2, 16), (0, 2, 1)))  # each [BN, 16]
    s = _fwd_perm_scales(ws_ptr, offs_n, n_mask, k0, stride_sn, FMT, 8)
    s0, s1 = tl.split(tl.permute(s.reshape(BLOCK_N, 2, 4), (0, 2, 1)))  # each [BN, 4]
    w = _fwd_perm_decode(q0.reshape(BLOCK_N, 4, 4), s0, FMT, USE_ASM)
    acc = _mma(w, tl.trans(_fwd_perm_x(x_rows, row_mask, k0)), acc, INTERP)
    w = _fwd_perm_decode(q1.reshape(BLOCK_N, 4, 4), s1, FMT, USE_ASM)
    return _mma(w, tl.trans(_fwd_perm_x(x_rows, row_mask, k0 + 128)), acc, INTERP)


@triton.jit
def _total_tiles(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Row tiles of all experts together (the count :func:`_schedule` numbers)."""
    return tl.sum(_expert_row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)[3], 0)


@triton.jit
def _output_tile_bases(x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt, stride_we, stride_se,
                       BLOCK_N: tl.constexpr):
    """Columns ``offs_n`` (and their mask) of output tile ``pid_n``, expert ``e``'s weight and scale bases and the
    activation rows' pointers ``[BM, 1]``."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    e64 = e.to(tl.int64)
    wq_e = wq_ptr + e64 * stride_we
    ws_e = ws_ptr + e64 * stride_se
    return offs_n, n_mask, wq_e, ws_e, x_ptr + rows.to(tl.int64)[:, None] * stride_xt


@triton.jit
def _fwd_perm_steps(wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k_lo, k_hi, stride_wn, stride_sn,
                    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                    INTERP: tl.constexpr, ROW_LOADS: tl.constexpr, K_PAIRS: tl.constexpr = False):
    """fp32 ``acc [BN, BM]`` = the permuted forward's products over the 128-wide K steps from ``k_lo`` to ``k_hi``,
    added in step order. ``K_PAIRS``: two steps per loop iteration (:func:`_fwd_perm_pair`; ``k_lo`` and ``k_hi``
    multiples of 256), the same sums."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if K_PAIRS:
        for k0 in range(k_lo, k_hi, FWD_PAIR_STEP):
            acc = _fwd_perm_pair(wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn, acc, FMT,
                                 USE_ASM, INTERP)
    else:
        for k0 in range(k_lo, k_hi, FWD_STEP):
            w, x = _fwd_perm_tile(wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn,
                                  FMT, BLOCK_N, USE_ASM, ROW_LOADS)
            acc = _mma(w, tl.trans(x), acc, INTERP)  # [BN, BM]
    return acc


@triton.jit
def _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt):
    """``y[rows, offs_n] = bf16(acc^T)`` for fp32 ``acc [BN, BM]``, masked to the tile's rows and columns."""
    y = tl.trans(acc).to(tl.bfloat16)  # [BM, BN]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, y, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _fwd_perm_output(x_ptr, wq_ptr, ws_ptr, y_ptr, e, pid_n, rows, row_mask, N, K,
                     stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                     FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                     INTERP: tl.constexpr, ROW_LOADS: tl.constexpr, K_PAIRS: tl.constexpr = False):
    """One output tile of the permuted forward: ``y[rows, pid_n * BLOCK_N :][:BLOCK_N]`` of expert ``e``."""
    offs_n, n_mask, wq_e, ws_e, x_rows = _output_tile_bases(x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt,
                                                            stride_we, stride_se, BLOCK_N)
    acc = _fwd_perm_steps(wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, 0, K, stride_wn, stride_sn, FMT, BLOCK_M,
                          BLOCK_N, USE_ASM, INTERP, ROW_LOADS, K_PAIRS)
    _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt)


@triton.jit
def _fwd_perm_tail_piece(x_ptr, wq_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, piece, e, pid_n, rows, row_mask, N, K,
                         stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                         FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                         INTERP: tl.constexpr, ROW_LOADS: tl.constexpr, TAIL_SPLIT: tl.constexpr,
                         K_PAIRS: tl.constexpr = False):
    """Piece ``piece % TAIL_SPLIT`` of tail tile ``piece // TAIL_SPLIT``: that range of the reduction's 128-wide steps
    (whole steps, or whole pairs of steps with ``K_PAIRS``; the last range shorter), its fp32 partial sum ``[BN, BM]``
    written to ``part_ptr`` slot ``piece``; the tile's last piece to finish (a counter per tile in ``count_ptr``,
    zeroed by the launcher) adds the tile's ``TAIL_SPLIT`` partial sums in piece order and stores the bf16 tile, so
    the result does not depend on which piece finished last."""
    offs_n, n_mask, wq_e, ws_e, x_rows = _output_tile_bases(x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt,
                                                            stride_we, stride_se, BLOCK_N)
    j = piece // TAIL_SPLIT
    STEP: tl.constexpr = FWD_PAIR_STEP if K_PAIRS else FWD_STEP
    k_len = tl.cdiv(K // STEP, TAIL_SPLIT) * STEP
    k_lo = (piece % TAIL_SPLIT) * k_len
    k_hi = tl.minimum(K, k_lo + k_len)
    acc = _fwd_perm_steps(wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k_lo, k_hi, stride_wn, stride_sn, FMT,
                          BLOCK_M, BLOCK_N, USE_ASM, INTERP, ROW_LOADS, K_PAIRS)
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(part_ptr + piece.to(tl.int64) * (BLOCK_N * BLOCK_M) + offs, acc)
    tl.debug_barrier()  # every thread's partial stored before the counter's release
    done = tl.atomic_add(count_ptr + j, 1, sem="acq_rel", scope="gpu")
    if done == TAIL_SPLIT - 1:
        first = part_ptr + (j * TAIL_SPLIT).to(tl.int64) * (BLOCK_N * BLOCK_M) + offs
        total = tl.load(first, cache_modifier=".cg")  # from L2: other SMs wrote the pieces
        for s in tl.static_range(1, TAIL_SPLIT):
            total += tl.load(first + s * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
        _store_fwd_tile(y_ptr, total, rows, row_mask, offs_n, n_mask, stride_yt)


@triton.jit
def w4a16_fwd_perm_kernel(x_ptr, wq_ptr, ws_ptr, y_ptr, offsets_ptr, N, K, E,
                          stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                          FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          GROUP_M: tl.constexpr, E_POW2: tl.constexpr, USE_ASM: tl.constexpr,
                          INTERP: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
                          ROW_LOADS: tl.constexpr = False, TAIL_SPLIT: tl.constexpr = 1, full_tiles=0,
                          part_ptr=None, count_ptr=None, K_PAIRS: tl.constexpr = False):
    """Forward with word-level decoding; ``K % 128 == 0``, weights viewed as int32 words ``[E, N, K / 8]``.

    One program per output tile, or (``PERSISTENT``, experimental) fewer programs each walking the tiles
    ``program_id, program_id + programs, ...`` in one loop nest that the compiler flattens, so the loads of a tile's
    first K steps are issued while the previous tile's last steps run (at 8 tokens per expert a K3 fc1 tile is only
    28 K steps, each program otherwise ramping its own 3-stage pipeline).

    ``TAIL_SPLIT > 1`` (one program per tile only): the tiles from ``full_tiles`` on, the last, partly filled wave of
    programs, each run as ``TAIL_SPLIT`` programs over ranges of the reduction (:func:`_fwd_perm_tail_piece`: fp32
    partial sums in ``part_ptr``, ``[tail tiles * TAIL_SPLIT, BN, BM]``, a zeroed int32 counter per tail tile in
    ``count_ptr``), so the last wave takes a fraction of a tile's time instead of a whole one.

    ``K_PAIRS`` (``K % 256 == 0``): two K steps per loop iteration, a row's 128 bytes of them loaded as one run
    (:func:`_fwd_perm_pair`); the same sums in the same order, so the same bits.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        total = _total_tiles(offsets_ptr, E, BLOCK_M, E_POW2) * num_n
        for t in tl.range(pid, total, tl.num_programs(0), flatten=True):
            _, e, pid_n, rows, row_mask = _schedule(t, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
            _fwd_perm_output(x_ptr, wq_ptr, ws_ptr, y_ptr, e, pid_n, rows, row_mask, N, K, stride_xt, stride_we,
                             stride_wn, stride_se, stride_sn, stride_yt, FMT, BLOCK_M, BLOCK_N, USE_ASM, INTERP,
                             ROW_LOADS, K_PAIRS)
    elif TAIL_SPLIT > 1:
        piece = pid - full_tiles  # >= 0: a piece of tail tile full_tiles + piece // TAIL_SPLIT
        tile = tl.where(piece < 0, pid, full_tiles + piece // TAIL_SPLIT)
        valid, e, pid_n, rows, row_mask = _schedule(tile, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
        if valid:
            if piece < 0:
                _fwd_perm_output(x_ptr, wq_ptr, ws_ptr, y_ptr, e, pid_n, rows, row_mask, N, K, stride_xt,
                                 stride_we, stride_wn, stride_se, stride_sn, stride_yt, FMT, BLOCK_M, BLOCK_N,
                                 USE_ASM, INTERP, ROW_LOADS, K_PAIRS)
            else:
                _fwd_perm_tail_piece(x_ptr, wq_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, piece, e, pid_n, rows,
                                     row_mask, N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                                     stride_yt, FMT, BLOCK_M, BLOCK_N, USE_ASM, INTERP, ROW_LOADS, TAIL_SPLIT,
                                     K_PAIRS)
    else:
        valid, e, pid_n, rows, row_mask = _schedule(pid, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
        if valid:
            _fwd_perm_output(x_ptr, wq_ptr, ws_ptr, y_ptr, e, pid_n, rows, row_mask, N, K, stride_xt, stride_we,
                             stride_wn, stride_se, stride_sn, stride_yt, FMT, BLOCK_M, BLOCK_N, USE_ASM, INTERP,
                             ROW_LOADS, K_PAIRS)


@triton.jit
def w4a16_fwd_kernel(x_ptr, wq_ptr, ws_ptr, y_ptr, offsets_ptr, N, K, E,
                     stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                     FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_POW2: tl.constexpr,
                     EVEN_K: tl.constexpr, INTERP: tl.constexpr = False):
    """``y[rows_e] = x[rows_e] . dequant(W_e)^T``; one program per (row tile, BLOCK_N columns)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    valid, e, pid_n, rows, row_mask = _schedule(pid, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
    if valid:
        offs_n, n_mask, wq_e, ws_e, x_rows = _output_tile_bases(x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt,
                                                                stride_we, stride_se, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None], other=0.0)
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            w = _load_weight_tile(wq_e, ws_e, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                                  FMT, BLOCK_N, BLOCK_K, EVEN_K)  # [BN, BK] bf16
            acc = _mma(w, tl.trans(x), acc, INTERP)  # [BN, BM]
        _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt)


@triton.jit
def w4a16_dgrad_kernel(dy_ptr, wq_ptr, ws_ptr, dx_ptr, offsets_ptr, N, K, E,
                       stride_dyt, stride_we, stride_wn, stride_se, stride_sn, stride_dxt,
                       FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_POW2: tl.constexpr,
                       EVEN_N: tl.constexpr, INTERP: tl.constexpr = False):
    """``dx[rows_e] = dy[rows_e] . dequant(W_e)``; one program per (row tile, BLOCK_K input columns).

    The reduction runs over ``N`` in steps of ``BLOCK_N``; ``K`` must be a multiple of ``BLOCK_K``
    (the launcher checks), so the weight tile's columns never need a mask.
    """
    pid = tl.program_id(0)
    num_k = K // BLOCK_K
    valid, e, pid_k, rows, row_mask = _schedule(pid, offsets_ptr, E, num_k, BLOCK_M, E_POW2, GROUP_M)
    if valid:
        k0 = pid_k * BLOCK_K
        e64 = e.to(tl.int64)
        wq_e = wq_ptr + e64 * stride_we
        ws_e = ws_ptr + e64 * stride_se
        dy_rows = dy_ptr + rows.to(tl.int64)[:, None] * stride_dyt  # [BM, 1]
        acc = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            if EVEN_N:
                dy = tl.load(dy_rows + offs_n[None, :], mask=row_mask[:, None], other=0.0)
            else:
                dy = tl.load(dy_rows + offs_n[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
            w = _load_weight_tile(wq_e, ws_e, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                                  FMT, BLOCK_N, BLOCK_K, True)  # [BN, BK]
            acc = _mma(tl.trans(w), tl.trans(dy), acc, INTERP)  # [BK, BM]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        dx = tl.trans(acc).to(tl.bfloat16)  # [BM, BK]
        dx_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * stride_dxt + offs_k[None, :]
        tl.store(dx_ptrs, dx, mask=row_mask[:, None])


@triton.jit
def w4a16_dgrad_perm_kernel(dy_ptr, wq_ptr, ws_ptr, dx_ptr, offsets_ptr, N, K, E,
                            stride_dyt, stride_we, stride_wn, stride_se, stride_sn, stride_dxt,
                            FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            GROUP_M: tl.constexpr, E_POW2: tl.constexpr, USE_ASM: tl.constexpr,
                            EVEN_N: tl.constexpr, INTERP: tl.constexpr = False, SPLIT_N: tl.constexpr = 1,
                            stride_part=0, ROW_LOADS: tl.constexpr = False):
    """dgrad with word-level decoding; 256 input columns per program, ``K % 256 == 0``.

    ``SPLIT_N > 1`` splits the reduction over ``N`` into that many ranges of whole ``BLOCK_N`` steps, range
    ``program_id(1)``; each writes its fp32 partial sum to ``dx_ptr + program_id(1) * stride_part`` (a ``[SPLIT_N,
    T, K]`` fp32 buffer the launcher sums). For layers with few output tiles (K2 fc2: ``K = 2048`` is 8 tiles per
    expert, 192 programs for 132 SMs at 8 tokens per expert) it multiplies the programs in flight.

    The MMA computes ``acc[256, BLOCK_M] = W^T . dy^T`` with the 256 rows in a permuted order:
    physical column ``k = 8m + e`` of the tile (word ``m = 8a + 4b + c``, element ``e = 4r1 + 2r0 + h``)
    is logical row ``128 r1 + 64 r0 + 16 a + 8 h + 4 b + c``. With 4 warps, logical rows
    ``{64 r + 16 warp + g + 8 h}`` sit in one thread, so the 8 elements of a word land in the
    thread that decoded it; its two rows ``n, n + 1`` pair up along the reduction axis as the
    operand registers want. The epilogue undoes the permutation before the store.

    ``ROW_LOADS``: a row's 32 words of the tile are loaded as ``[BN, 2, 16]`` (two 64-byte runs) and reshaped to
    ``[BN, 4, 2, 4]`` after the load, so 4 lanes share 64 bytes of a row and a 16-byte ``cp.async`` instruction covers
    8 rows (loaded as ``[BN, 4, 2, 4]`` a warp's lanes sit on 32 rows of 16 bytes each).
    """
    pid = tl.program_id(0)
    num_k = K // 256
    valid, e, pid_k, rows, row_mask = _schedule(pid, offsets_ptr, E, num_k, BLOCK_M, E_POW2, GROUP_M)
    if valid:
        k0 = pid_k * 256
        e64 = e.to(tl.int64)
        wq_e = wq_ptr + e64 * stride_we
        ws_e = ws_ptr + e64 * stride_se
        dy_rows = dy_ptr + rows.to(tl.int64)[:, None] * stride_dyt  # [BM, 1]
        i_a = tl.arange(0, 4)
        i_b = tl.arange(0, 2)
        i_c = tl.arange(0, 4)
        grp = 2 * i_a[:, None] + i_b[None, :]  # [4(a), 2(b)] scale group of the tile
        word = k0 // 8 + 4 * grp[:, :, None] + i_c[None, None, :]  # [4, 2, 4]
        acc = tl.zeros((256, BLOCK_M), dtype=tl.float32)
        n_steps = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT_N)  # BLOCK_N steps per range
        n_lo = tl.program_id(1) * n_steps * BLOCK_N
        for n0 in range(n_lo, tl.minimum(N, n_lo + n_steps * BLOCK_N), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            if ROW_LOADS:  # a row's 32 words of the tile as 2 runs of 16: 4 lanes per row's 64 bytes (a flat [BN, 32]
                # load gets a row-fastest shared layout and 4-byte copies; [BN, 4, 8] gets 16 rows x 32 bytes)
                w_ptrs = wq_e + offs_n[:, None, None] * stride_wn + (k0 // 8 + 16 * tl.arange(0, 2)[:, None]
                                                                     + tl.arange(0, 16)[None, :])[None]
                w_mask = n_mask[:, None, None]
            else:
                w_ptrs = wq_e + offs_n[:, None, None, None] * stride_wn + word[None, :, :, :]
                w_mask = n_mask[:, None, None, None]
            s_ptrs = ws_e + offs_n[:, None] * stride_sn + (k0 // 32 + tl.arange(0, 8))[None, :]
            if EVEN_N:
                dy = tl.load(dy_rows + offs_n[None, :], mask=row_mask[:, None], other=0.0)
                q = tl.load(w_ptrs)
                sb = tl.load(s_ptrs)  # [BN, 8]
            else:
                dy = tl.load(dy_rows + offs_n[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
                q = tl.load(w_ptrs, mask=w_mask, other=0)
                if FMT != 1:  # E8M0 bytes (MXFP4, folded or not)
                    sb = tl.load(s_ptrs, mask=n_mask[:, None], other=127)
                else:
                    sb = tl.load(s_ptrs, mask=n_mask[:, None], other=0.0)
            q = q.reshape(BLOCK_N, 4, 2, 4)  # int32 [BN, 4(a), 2(b), 4(c)]
            sb = _scale_bf16(sb.reshape(BLOCK_N, 4, 2), FMT)
            s4 = tl.broadcast_to(sb[:, :, :, None], (BLOCK_N, 4, 2, 4))
            o0, o1, o2, o3, o4, o5, o6, o7 = _decode_words(q, s4, FMT, USE_ASM)
            p = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
            # p: [BN, a, b, c, h, r0, r1] -> [r1, r0, a, h, b, c, BN]
            wt = tl.permute(p, (6, 5, 1, 4, 2, 3, 0)).reshape(256, BLOCK_N)
            acc = _mma(wt, tl.trans(dy), acc, INTERP)  # [256, BM]
        if SPLIT_N == 1:
            d = tl.trans(acc).to(tl.bfloat16)  # [BM, 256] logical columns
        else:
            d = tl.trans(acc)  # fp32 partial sum
        # [BM, r1, r0, a, h, b, c] -> [BM, a, b, c, r1, r0, h]
        d = tl.permute(d.reshape(BLOCK_M, 2, 2, 4, 2, 2, 4), (0, 3, 5, 6, 1, 2, 4)).reshape(BLOCK_M, 256)
        offs_k = k0 + tl.arange(0, 256)
        part = dx_ptr + tl.program_id(1).to(tl.int64) * stride_part
        dx_ptrs = part + rows.to(tl.int64)[:, None] * stride_dxt + offs_k[None, :]
        tl.store(dx_ptrs, d, mask=row_mask[:, None])


@triton.jit
def sum_partials_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = bf16(part[0] + part[1] + ... + part[SPLIT - 1])``, summed in fp32 in that order: a split dgrad's fp32
    partial sums ``[SPLIT, numel]`` (contiguous) into its bf16 output ``[numel]`` (contiguous) in one pass, instead
    of a reduction kernel and a cast kernel."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ptrs = part_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLIT):
        ptrs += numel
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fmt_id(fmt: str) -> int:
    return FMT_MXFP4 if fmt == "mxfp4-pack-quantized" else FMT_INT4


def _sum_partials(part, out) -> None:
    """``out`` (bf16 ``[T, K]``) = the sum over a split's fp32 partial sums ``part`` (``[split, T, K]``, contiguous):
    :func:`sum_partials_kernel` where ``out`` is contiguous, else torch's. One pass: under Nsight Compute (H100,
    2026-12-06) K2 fc2's MXFP4 dgrad at 8 tokens per expert ran torch's sum (8.7 us) and cast (3.6 us) after its
    119 us kernel."""
    if not out.is_contiguous():
        out.copy_(part.sum(0))
        return
    numel = out.numel()
    block = 1024
    sum_partials_kernel[(triton.cdiv(numel, block),)](part, out, numel, SPLIT=part.shape[0], BLOCK=block,
                                                      num_warps=4)


def _as_words(w_packed):
    """Packed weights as int32 words ``[E, N, K / 8]`` (MXFP4 bytes are reinterpreted, not copied)."""
    import torch

    if w_packed.dtype == torch.uint8:
        w_packed = w_packed.contiguous().view(torch.int32)
    return w_packed.contiguous()


def _offsets(m_splits, num_experts: int, device):
    """``(offsets int32 [E + 1] on device, host list of splits or None)``."""
    import torch

    from kimi_core.kernels.host_ints import host_offsets, int32_on

    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type == "cpu":
            splits = [int(v) for v in m_splits.tolist()]
        else:
            off = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
            off[1:] = torch.cumsum(m_splits.to(device=device, dtype=torch.int32), 0)
            return off, None
    else:
        splits = [int(v) for v in m_splits]
    return int32_on(host_offsets(splits), device), splits


def _num_programs(splits, total_rows: int, num_experts: int, block_m: int, num_cols: int) -> int:
    if splits is not None:
        tiles = sum((v + block_m - 1) // block_m for v in splits)
    else:  # device-side splits: an upper bound; programs past the last tile exit at once
        tiles = (total_rows + block_m - 1) // block_m + num_experts
    return max(tiles, 1) * num_cols


def _e_pow2(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


# the forward's last wave is split over the reduction only when at least this share of the slots runs it
TAIL_MIN_FILL = 0.25


def fwd_steps(K: int, k_pairs: bool) -> int:
    """Loop iterations of the permuted forward over a reduction of ``K``: 128-wide K steps, or pairs of them with
    ``K_PAIRS`` (the units :func:`tail_pieces` cuts a split tile's reduction into)."""
    return K // (FWD_PAIR_STEP.value if k_pairs else FWD_STEP.value)


def tail_pieces(programs: int, slots: int, most: int, steps: int) -> tuple[int, int]:
    """``(full, pieces)``: the forward's ``programs`` tiles on ``slots`` resident programs (SMs x programs per SM)
    fill ``programs // slots`` whole waves, the ``full`` first tiles; each of the ``programs - full`` left (the last,
    partly filled wave, or every tile under one wave) runs as ``pieces`` programs over ranges of its ``steps``
    reduction steps, as many as fit in one wave of slots, at most ``most``, none of them empty (1: no split).

    A last wave under :data:`TAIL_MIN_FILL` of the slots is not split: its few tiles run with the whole GPU's memory
    bandwidth to themselves, and the split's partial sums and counters cost more than it saves (H100, 2026-12-06,
    8 tok/exp: K2 fc2's 48 tiles on 660 slots 2 % slower split in 4; K2 fc1's third-full last wave 6 % faster)."""
    n_tail = programs % slots if slots > 0 else 0
    if n_tail == 0 or n_tail < TAIL_MIN_FILL * slots:
        return programs, 1
    pieces = max(1, min(most, slots // n_tail, steps))
    per_piece = -(-steps // pieces)  # whole steps per piece, as the kernel cuts them
    return programs - n_tail, -(-steps // per_piece)  # no empty piece


_SLOTS_PER_SM: dict = {}


def _fwd_slots_per_sm(args: tuple, consts: dict, pieces: int = 1, full: int = 0) -> int:
    """Programs of the forward kernel (``w4a16_fwd_perm_kernel`` with ``args`` / ``consts``, unsplit or, ``pieces >
    1``, its last wave's tiles from ``full`` on split in that many; compiled if not yet) resident per SM of the current
    device, as the driver counts them (:mod:`.occupancy`). Cached per device, constants and the ints' specialization
    (Triton's: equal to 1, a multiple of 16), so a shape always splits the same way and its results do not depend on
    what ran before."""
    import torch

    split = pieces > 1
    ints = tuple((a == 1, a % 16 == 0) for a in (*args, *((full,) if split else ())) if isinstance(a, int))
    key = (torch.cuda.current_device(), ints, tuple(sorted(consts.items())), pieces)
    if key not in _SLOTS_PER_SM:
        from kimi_core.kernels.occupancy import resident_programs

        device = args[0].device
        tail = dict(TAIL_SPLIT=pieces, full_tiles=full, part_ptr=torch.empty(1, device=device),
                    count_ptr=torch.zeros(1, dtype=torch.int32, device=device)) if split else {}
        _SLOTS_PER_SM[key] = resident_programs(w4a16_fwd_perm_kernel.warmup(*args, grid=(1,), **tail, **consts))
    return _SLOTS_PER_SM[key]


def _size_tail_split(programs: int, args: tuple, consts: dict, most: int, steps: int, slots_per_sm: int,
                     device) -> tuple[int, dict]:
    """``(programs to launch, the split forward's extra arguments)`` for ``programs`` tiles: ``TAIL_SPLIT``,
    ``full_tiles``, the tail tiles' fp32 partial sums ``[tail tiles * TAIL_SPLIT, BLOCK_N, BLOCK_M]`` and zeroed int32
    counters ``[tail tiles]``; ``(programs, {})`` where the last wave is not split (:func:`tail_pieces`).
    ``slots_per_sm`` given (``SLOTS_PER_SM``): that many programs per SM. Else the driver's count for the unsplit kernel
    sizes the split, and the split kernel that picks, which runs every tile of the launch, is counted too: where it
    holds fewer programs per SM nothing splits (sm_90a, MXFP4's exact two-multiply decode paired: 100-109 registers, 4
    blocks against the unsplit 96's 5; H100 2026-12-07 at 8 tok/exp, K3 fc1 unsplit 0.568 ms, split for 4 per SM 0.583,
    for 5 per SM 0.593; K2 fc1 0.182 / 0.181 / 0.177)."""
    import torch

    counted = not slots_per_sm
    if counted:
        slots_per_sm = _fwd_slots_per_sm(args, consts)
    full, pieces = tail_pieces(programs, slots_per_sm * sm_count(device), most, steps)
    if pieces == 1 or (counted and _fwd_slots_per_sm(args, consts, pieces, full) < slots_per_sm):
        return programs, {}
    n_tail = programs - full
    return full + n_tail * pieces, dict(
        TAIL_SPLIT=pieces, full_tiles=full,
        part_ptr=torch.empty((n_tail * pieces, consts["BLOCK_N"], consts["BLOCK_M"]), dtype=torch.float32,
                             device=device),
        count_ptr=torch.zeros(n_tail, dtype=torch.int32, device=device))


def fwd_config(tokens_per_expert: float, fmt: str = "") -> dict:
    """Forward tiles by mean tokens per expert (swept on K3 fc1 on the H200, 2026-11-29; up to 128 on every benchmark
    shape and both formats on an H100, 2026-12-06, benchmarks/RESULTS.md). The weights go as runs along each row
    (``ROW_LOADS``): 10-25 % faster up to 64 tokens per expert; at 128-row tiles MXFP4 gains 3-7 %, INT4 loses
    3-6 %. Up to 32, two K steps per loop iteration (``K_PAIRS``, 3 stages; H100 2026-12-06 at 8 tok/exp: 12-24 %
    faster on every shape and format, K2 fc1 MXFP4 0.214 -> 0.171 ms; at 32 fastest on 7 of 8 rows, INT4 up to 19 %;
    at 64 slower). At 16 and fewer the last wave's tiles split over the reduction in up to 4 pieces (``TAIL_SPLIT``,
    :func:`tail_pieces`; K2 fc1 MXFP4 at 8 tok/exp 6 % faster unpaired, H100 2026-12-06)."""
    mxfp4 = fmt == "mxfp4-pack-quantized"
    if tokens_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, ROW_LOADS=True, TAIL_SPLIT=4, K_PAIRS=True)
    if tokens_per_expert <= 32:
        return dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3, ROW_LOADS=True, K_PAIRS=True)
    if tokens_per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, ROW_LOADS=True)
    return dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, ROW_LOADS=mxfp4)


# the permuted dgrad splits its reduction over N in SPLIT_N_FEW_PROGRAMS ranges when it would otherwise run fewer than
# SPLIT_BELOW_WAVES programs per SM (H100, 8 tokens per expert, 2026-12-06: K2 fc2, 192 programs on 132 SMs, 0.194 ->
# 0.148 ms MXFP4, 0.176 -> 0.149 ms INT4 with 4 ranges; uncapped, K2 fc1's 672 programs gain nothing, K3's 1568 lose
# 5-20 %)
SPLIT_BELOW_WAVES = 2
SPLIT_N_FEW_PROGRAMS = 4
# the few-token dgrad tile (16 rows) capped at DGRAD_MAXNREG registers holds 5 programs per SM instead of 2-4 (sm_90a:
# MXFP4 94 registers instead of 162-178, INT4 89-96 instead of 109-183, no spills); from SPLIT_BELOW_WAVES up to
# CAPPED_SPLIT_BELOW_WAVES programs per SM it is capped and split in SPLIT_N_FEW_PROGRAMS, above that folded MXFP4 is
# capped whole. H100 2026-12-07, 8 tok/exp, two sweeps: K2 fc1 (672 programs) 0.200-0.203 -> 0.188 ms MXFP4,
# 0.192-0.193 -> 0.185 ms INT4; K3 fc1 MXFP4 0.543-0.546 -> 0.533-0.535, K3 fc2 MXFP4 0.299-0.300 -> 0.286-0.290; INT4
# whole capped no faster (K3 fc1 0.569 vs 0.548); K2 fc2's 192 programs capped and split in 4 slower (0.117-0.120 vs
# 0.100-0.103 ms uncapped; in 2, below, faster).
# MXFP4's exact two-multiply decode (a scale byte over 128) also compiles to 94 registers without spills capped; its
# capped split is planned like the folded one's but was not timed
DGRAD_MAXNREG = 96
CAPPED_SPLIT_BELOW_WAVES = 8
# under SPLIT_BELOW_WAVES programs per SM the 16-row tile is capped too, split in CAPPED_SPLIT_N_FEW_PROGRAMS ranges
# (H100 2026-12-07, K2 fc2 at 8 tok/exp, 192 programs: capped in 2 ranges, 384 programs on 660 capped slots, 0.103 ms
# MXFP4 / 0.102 INT4 against the uncapped 4 ranges' 0.106 / 0.103; capped in 3, 5, 6, 8: 0.106-0.116; in 4: 0.120-0.123)
CAPPED_SPLIT_N_FEW_PROGRAMS = 2


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a CPU run under the interpreter: 1, so nothing splits)."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def dgrad_occupancy(cfg: dict, programs: int, sms: int, kernel_fmt: int) -> dict:
    """The shipped permuted dgrad tile ``cfg`` (:func:`dgrad_config`) for a launch of ``programs`` programs on ``sms``
    SMs decoding ``kernel_fmt`` (:func:`.gluon_w4a16.kernel_fmt_id`). Tiles of 32 or more rows: under
    :data:`SPLIT_BELOW_WAVES` programs per SM the reduction over N split in :data:`SPLIT_N_FEW_PROGRAMS` ranges of 64
    rows, else as they are. The few-token 16-row tile: capped at :data:`DGRAD_MAXNREG` registers and split in
    :data:`CAPPED_SPLIT_N_FEW_PROGRAMS` ranges under :data:`SPLIT_BELOW_WAVES` programs per SM, in
    :data:`SPLIT_N_FEW_PROGRAMS` under :data:`CAPPED_SPLIT_BELOW_WAVES`; above that whole, capped only where the decode
    is folded MXFP4 (measured faster there only)."""
    split = dict(cfg, BLOCK_N=64, SPLIT_N=SPLIT_N_FEW_PROGRAMS)
    if cfg["BLOCK_M"] != 16:
        return split if programs < SPLIT_BELOW_WAVES * sms else cfg
    if programs < SPLIT_BELOW_WAVES * sms:
        return dict(split, SPLIT_N=CAPPED_SPLIT_N_FEW_PROGRAMS, maxnreg=DGRAD_MAXNREG)
    if programs < CAPPED_SPLIT_BELOW_WAVES * sms:
        return dict(split, maxnreg=DGRAD_MAXNREG)
    return dict(cfg, maxnreg=DGRAD_MAXNREG) if kernel_fmt == FMT_MXFP4_FOLDED else cfg


def dgrad_config(tokens_per_expert: float, fmt: str = "") -> dict:
    """dgrad tiles by mean tokens per expert (swept on K3 fc1 on the H200, 2026-11-29; up to 128 on every benchmark
    shape and both formats on an H100, 2026-12-06): the weights as runs along each row (``ROW_LOADS``: 14-45 % faster
    from 8 to 64 tokens per expert); 64-row reduction steps, except INT4 from 17 to 32 tokens per expert (32-row
    steps, 1-10 % faster there)."""
    if tokens_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, ROW_LOADS=True)
    if tokens_per_expert <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64 if fmt == "mxfp4-pack-quantized" else 32, num_warps=4, num_stages=4,
                    ROW_LOADS=True)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, ROW_LOADS=True)


def grouped_gemm(x, w_packed, w_scale, fmt: str, m_splits, config: dict | None = None, out=None,
                 fold_scales: bool = False):
    """Triton forward; arguments as :func:`kimi_core.kernels.w4a16_grouped_gemm` (already validated).

    ``config`` overrides the tile choice (benchmarks; ``PERSISTENT``: that many programs per SM walking the tiles,
    experimental; ``ROW_LOADS``: the permuted kernels' weight loads as runs along a row; ``TAIL_SPLIT``, host splits
    only: the last wave's tiles in up to that many pieces, :func:`tail_pieces`, on as many resident programs per SM
    as ``SLOTS_PER_SM`` says, or else as the driver counts for the compiled kernels (:func:`_size_tail_split`; on the
    CPU none, so nothing splits); ``K_PAIRS``: the permuted forward's two K steps per iteration where ``K % 256 ==
    0``, its weights always loaded as runs along a row); ``out`` is an optional ``[T, N]`` bf16 output;
    ``fold_scales``: the permuted kernel decodes MXFP4 with one multiply where every scale byte allows it
    (:func:`.gluon_w4a16.kernel_fmt_id`; the same bits).
    """
    import torch

    T, K = x.shape
    E, N = w_packed.shape[0], w_packed.shape[1]
    y = out if out is not None else torch.empty((T, N), dtype=torch.bfloat16, device=x.device)
    if T == 0 or N == 0:
        return y
    offsets, splits = _offsets(m_splits, E, x.device)
    cfg = dict(config or fwd_config(T / E, fmt))
    x = x.contiguous()
    ws = w_scale.contiguous()
    fmt_id = _fmt_id(fmt)
    use_asm = not _interpreting()
    per_sm = cfg.pop("PERSISTENT", 0)  # experimental (permuted kernel): this many programs per SM walk all the tiles
    row_loads = cfg.pop("ROW_LOADS", False)  # permuted kernel only
    tail_split = cfg.pop("TAIL_SPLIT", 1)  # permuted kernel, one program per tile: see tail_pieces
    slots_per_sm = cfg.pop("SLOTS_PER_SM", 0)
    k_pairs = bool(cfg.pop("K_PAIRS", False)) and K % 256 == 0  # permuted kernel: two K steps per iteration
    if K % 128 == 0 and cfg.pop("PERM", True):
        wq = _as_words(w_packed)
        programs = _num_programs(splits, T, E, cfg["BLOCK_M"], triton.cdiv(N, cfg["BLOCK_N"]))
        grid = (min(programs, per_sm * sm_count(x.device)) if per_sm else programs,)
        args = (x, wq, ws, y, offsets, N, K, E, x.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1),
                y.stride(0))
        consts = dict(FMT=kernel_fmt_id(fmt_id, ws, fold_scales), GROUP_M=8, E_POW2=_e_pow2(E), USE_ASM=use_asm,
                      INTERP=not use_asm, PERSISTENT=bool(per_sm), ROW_LOADS=bool(row_loads), K_PAIRS=k_pairs,
                      **cfg)
        tail = {}
        driver_counts = use_asm and x.device.type == "cuda"  # resident programs per SM (else only SLOTS_PER_SM)
        if tail_split > 1 and not per_sm and splits is not None and (slots_per_sm or driver_counts):
            launched, tail = _size_tail_split(programs, args, consts, tail_split, fwd_steps(K, k_pairs), slots_per_sm,
                                              x.device)
            grid = (launched,)
        w4a16_fwd_perm_kernel[grid](*args, **tail, **consts)
    else:
        wq = w_packed.contiguous()
        cfg.setdefault("BLOCK_K", 128 if K % 128 == 0 else 32)
        grid = (_num_programs(splits, T, E, cfg["BLOCK_M"], triton.cdiv(N, cfg["BLOCK_N"])),)
        w4a16_fwd_kernel[grid](
            x, wq, ws, y, offsets, N, K, E, x.stride(0), wq.stride(0), wq.stride(1), ws.stride(0),
            ws.stride(1), y.stride(0), FMT=fmt_id, GROUP_M=8, E_POW2=_e_pow2(E),
            EVEN_K=K % cfg["BLOCK_K"] == 0, INTERP=_interpreting(), **cfg)
    return y


def grouped_gemm_dgrad(dy, w_packed, w_scale, fmt: str, m_splits, config: dict | None = None, out=None,
                       fold_scales: bool = False):
    """Triton dgrad; arguments as :func:`kimi_core.kernels.w4a16_grouped_gemm_dgrad` (already validated).

    ``config`` overrides the tile choice (benchmarks; ``SPLIT_N``: the reduction over N in that many ranges);
    ``out`` is an optional ``[T, K]`` bf16 output; ``fold_scales`` as :func:`grouped_gemm`.
    """
    import torch

    T, N = dy.shape
    E = w_packed.shape[0]
    K = w_scale.shape[2] * 32
    dx = out if out is not None else torch.empty((T, K), dtype=torch.bfloat16, device=dy.device)
    if T == 0 or K == 0:
        return dx
    if N == 0:
        return dx.zero_()
    offsets, splits = _offsets(m_splits, E, dy.device)
    cfg = dict(config or dgrad_config(T / E, fmt))
    dy = dy.contiguous()
    ws = w_scale.contiguous()
    fmt_id = _fmt_id(fmt)
    if K % 256 == 0 and cfg.pop("PERM", True):
        wq = _as_words(w_packed)
        programs = _num_programs(splits, T, E, cfg["BLOCK_M"], K // 256)
        kernel_fmt = kernel_fmt_id(fmt_id, ws, fold_scales)
        if config is None:
            cfg = dgrad_occupancy(cfg, programs, sm_count(dy.device), kernel_fmt)
        row_loads = cfg.pop("ROW_LOADS", False)
        split = min(cfg.pop("SPLIT_N", 1), triton.cdiv(N, cfg["BLOCK_N"]))
        # split > 1: fp32 partial sums [split, T, K], summed below; automatic only under 2 programs per SM (64-row
        # tiles) or 8 (16-row tiles), where T * K < 128 * SMs * 256 bounds them (69 MB at 132 SMs)
        part = dx if split == 1 else torch.empty((split, T, K), dtype=torch.float32, device=dy.device)
        grid = (programs, split)
        w4a16_dgrad_perm_kernel[grid](
            dy, wq, ws, part, offsets, N, K, E, dy.stride(0), wq.stride(0), wq.stride(1), ws.stride(0),
            ws.stride(1), part.stride(-2), FMT=kernel_fmt, GROUP_M=8,
            E_POW2=_e_pow2(E),
            USE_ASM=not _interpreting(), EVEN_N=N % cfg["BLOCK_N"] == 0, INTERP=_interpreting(), SPLIT_N=split,
            stride_part=part.stride(0) if split > 1 else 0, ROW_LOADS=bool(row_loads), **cfg)
        if split > 1:
            _sum_partials(part, dx)
    else:
        wq = w_packed.contiguous()
        cfg.pop("ROW_LOADS", None)  # the permuted kernel's option
        cfg.setdefault("BLOCK_K", 128 if K % 128 == 0 else 32)
        grid = (_num_programs(splits, T, E, cfg["BLOCK_M"], K // cfg["BLOCK_K"]),)
        w4a16_dgrad_kernel[grid](
            dy, wq, ws, dx, offsets, N, K, E, dy.stride(0), wq.stride(0), wq.stride(1), ws.stride(0),
            ws.stride(1), dx.stride(0), FMT=fmt_id, GROUP_M=8, E_POW2=_e_pow2(E),
            EVEN_N=N % cfg["BLOCK_N"] == 0, INTERP=_interpreting(), **cfg)
    return dx
