"""A warp-specialised W4A16 grouped GEMM (forward and dgrad) in Gluon (issue #21).

The fused Triton kernel (:mod:`.triton_w4a16`) decodes each 4-bit weight tile in the same warps that then
wait on its wgmma, so decode and MMA never overlap (340-390 TFLOP/s on K3 fc1 against BF16's ~700). Here
three partitions of one CTA (Gluon's ``warp_specialize``) each do one job, handing stages of shared-memory rings
to each other through mbarriers:

* the **loader** (1 warp) issues TMA copies into ``LOAD_STAGES``-deep rings: the packed weight bytes of each K
  step (``[BN, BK / 2]``; dgrad ``[BK, BN / 2]``) and their scales into ``p_ring`` / ``s_ring`` (arrive
  ``p_ready``), the activation tile ``[BM, BK]`` (``x``, or ``dy`` for dgrad, whose contraction runs over ``N``)
  into ``a_ring`` (``a_ready``);
* the **decoder** (``DECODE_WARPS`` warps) reads bytes and scales from shared memory (arrives ``p_free``), turns
  two 4-bit codes at a time into a bf16x2 pair with integer ops and two ``mul.rn.bf16x2`` (MXFP4: E2M1 codes x
  E8M0 group scales; INT4: offset-binary nibbles x bf16 group scales), the same exact arithmetic as
  :func:`kimi_core.quant.dequantize`, and writes the bf16 tile into the ``W_STAGES``-deep ``w_ring`` (``w_ready``);
* the **consumer** (default partition, one warpgroup per 128 output columns) runs ``warpgroup_mma`` with the
  weight tile as its M side and the activation tile as its N side into an fp32 ``[BN, BM]`` accumulator, arrives
  ``a_free`` / ``w_free`` once that wgmma has retired (loader and decoder wait on them before they refill a stage),
  then writes the masked bf16 tile back transposed.

Shapes and dtypes: ``x`` bf16 ``[T, K]`` with rows sorted by expert; ``w_packed`` ``[E, N, K/2]`` uint8 (MXFP4,
element ``2j`` in the low nibble) or ``[E, N, K/8]`` int32 (INT4, element ``8m + j`` in nibble ``j``: the same
bytes); ``w_scale`` ``[E, N, K/32]`` uint8 E8M0 or bf16; ``y`` bf16 ``[T, N]`` (dgrad: ``dy`` ``[T, N]`` ->
``dx`` ``[T, K]``). A work item is (``BN`` output columns, ``BM`` rows of one expert), from a host-built tile
table ``[tiles, 3]`` int32 = (expert, first row, end row); ``BM`` is 8 to 128 (:func:`pick_block_m`). One program
per work item, or (``persistent``) one per SM walking the items with its rings running on from one to the next, so
the next tile's loads and decode overlap this tile's epilogue and the rings are filled once per program. Rows of a
tile past its expert's end are computed and not stored; weight rows past ``N`` (dgrad's contraction) are zeroed.
Extra memory: none beyond the output and the tile table.

Status (2026-12-04, H200, Triton 3.6.0). First measured at commit 4db0841 (one 4-deep ring for everything): ~410
TFLOP/s at most; each 64-wide K step cost ~700 ns whatever its rows or decode warps, the loads leading the MMA by
only ~3 steps against a TMA round trip of about a microsecond. Since: the TMA rings have their own depth
(:func:`default_load_stages`), the persistent schedule (one ~200 KB, 168-register program fills an SM, so without
it every tile's ring fill and epilogue stand alone) and 256-column tiles (``block_n=256``: two wgmma warpgroups
share each activation tile, 28 KB read per 4.2 MFLOP step instead of 22 KB per 2.1). Correct on the H200 (fwd and
dgrad vs the fp32 oracle, decoded weights bit for bit; ``tests/kimi_core/kernels/test_gluon_w4a16_gpu.py``); best
0.53-0.59x BF16 at 512-2048 tokens per expert (256 columns, persistent; benchmarks/RESULTS.md "W4A16 grouped GEMM:
the Gluon kernels"). Both ops are faster in :mod:`.gluon_w4a16_rs`, which the dispatcher runs instead
(:data:`kimi_core.kernels.GLUON_OPTIONS`); this kernel stays as the ``kernel="smem"`` option and its reference.

:mod:`.gluon_w4a16_rs` is the forward and dgrad without the decoded tile in shared memory (the weights decoded into
the wgmma's register fragment); it reuses this module's loader, decode arithmetic, tile walk and argument checks.
"""

from __future__ import annotations

import dataclasses

import torch

from kimi_core.kernels.host_ints import int32_on

try:  # Triton >= 3.5 ships Gluon; older Tritons (and CPU-only installs) have no such module
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "mean_rows", "pick_block_m", "shape_fits", "tile_table", "grouped_gemm", "grouped_gemm_dgrad"]

BM, BN, BK = 128, 128, 64  # BM: rows of one expert per tile (fewer where experts have few rows: pick_block_m)
BLOCK_N_CHOICES = (128, 256)  # output columns per tile = weight rows of the wgmma's M side, one warpgroup per 128
MAX_LOAD_STAGES = 8  # TMA ring depth cap (activation tile + packed bytes + scales per stage)
RING_BUDGET = 200 * 1024  # shared bytes for the rings; the epilogue's scratch and the barriers take the rest of 227 KB
DECODE_WARPS = 4    # warps of the decode partition (4 or 8)
BLOCK_M_CHOICES = (8, 16, 32, 64, 128)  # activation rows per tile: the wgmma's N (see pick_block_m)
# FMT: triton_w4a16's format ids (FMT_MXFP4 = 0, FMT_INT4 = 1, from its _fmt_id), and:
FMT_MXFP4_FOLDED = 2  # MXFP4 whose E8M0 scales are all <= 128: the decode's 2^126 folded into the scales (one multiply;
#                       triton_w4a16's permuted kernels take the same id)


def w_stages(block_n: int = BN) -> int:
    """Decoded bf16 weight tiles in flight (how far the decoder may run ahead of the wgmma): 3 of ``[128, BK]``,
    2 of ``[256, BK]`` (32 KB each; a 256-wide step's wgmma takes twice as long, so two cover the same time)."""
    return 3 if block_n <= 128 else 2


def consumer_warps(block_n: int = BN) -> int:
    """Warps of the wgmma partition (the kernel's ``num_warps``): one warpgroup per 128 output columns, each holding
    a ``[128, BM]`` fp32 accumulator (up to 128 registers per thread)."""
    return block_n // 32


def decode_regs(decode_warps: int, block_n: int = BN) -> int:
    """Registers per thread of the decode partition (``setmaxnreg``), so that the wgmma warpgroups (128 fp32
    accumulator registers per thread each), the loader (1 warp, 40, in a warpgroup of its own) and the decoders fit
    one SM's 64 K registers: 4 consumer warps leave 160 for 4 decode warps, 120 for 8; 8 consumer warps (``block_n``
    256, 232 registers each) leave 120 for 4 decode warps (8 would get too few: ptxas spilled them)."""
    if block_n <= 128:
        return 160 if decode_warps <= 4 else 120
    return 120


def load_stage_bytes(block_m: int, dgrad: bool, block_n: int = BN, scales_t: bool = False) -> int:
    """Shared bytes of one TMA ring stage: the bf16 activation tile, the packed bytes and the 16-byte scale boxes
    (``scales_t``: the ``[block_n / 32, BK]`` box of transposed scales, at most 2 bytes each)."""
    scales = block_n // 32 * BK * 2 if scales_t else (BK if dgrad else block_n) * 16
    return block_m * BK * 2 + block_n * BK // 2 + scales


def default_load_stages(block_m: int, dgrad: bool, block_n: int = BN) -> int:
    """Depth of the TMA rings: as many stages (2 to :data:`MAX_LOAD_STAGES`) as fit :data:`RING_BUDGET` beside
    :func:`w_stages` decoded tiles. A stage is released only when its wgmma has retired, so the loads lead the MMA by
    about ``LOAD_STAGES - 1`` steps; with one 4-deep ring for everything, that lead against a TMA round trip of
    about a microsecond set the pace (~700 ns per step whatever the tile, benchmarks/RESULTS.md)."""
    budget = RING_BUDGET - w_stages(block_n) * block_n * BK * 2
    return max(2, min(MAX_LOAD_STAGES, budget // load_stage_bytes(block_m, dgrad, block_n)))


def mean_rows(m_splits) -> float:
    """Mean rows of the non-empty experts (0 when every expert is empty); ``m_splits`` is read on the host."""
    splits = [int(v) for v in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
    busy = [m for m in splits if m]
    return sum(busy) / len(busy) if busy else 0.0


def pick_block_m(m_splits) -> int:
    """Activation rows per tile (the wgmma's N side): the smallest of 8, 16, 32, 64, 128 at or above the mean rows
    of the non-empty experts, 128 above that (or when all are empty): a tile of an expert with few rows then reads
    and multiplies about the rows it has."""
    mean = mean_rows(m_splits) or BM
    return next((b for b in BLOCK_M_CHOICES if b >= mean), BM)


def tile_table(m_splits, block_m: int, device) -> torch.Tensor:
    """``[tiles, 3]`` int32 rows (expert, first row, end row) covering each expert's rows in ``block_m`` steps;
    empty experts get no tile. ``m_splits`` is read on the host."""
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
    rows, start = [], 0
    for e, m in enumerate(int(v) for v in splits):
        rows += [(e, r, start + m) for r in range(start, start + m, block_m)]
        start += m
    return int32_on(rows, device).reshape(-1, 3)  # reshape: no tiles at all gives [0] -> [0, 3]


if HAVE_GLUON:

    @gluon.jit
    def _bf16x2_decode(pairs, scale2, FMT: gl.constexpr):
        """int32 lanes of two 4-bit codes (``0x000c000c``-shaped: code of element ``2j`` in bits 0-3, of ``2j + 1``
        in bits 16-19) and a bf16x2 scale pair -> int32 holding the two dequantized bf16 (element ``2j`` low).

        MXFP4: the E2M1 code ``s|e e m`` placed as bf16 bits ``s << 15 | eem << 6`` is the code's value times
        ``2^-126`` (``e = 0`` lands on bf16 subnormals, exactly ``m/2 * 2^-126``); one bf16x2 multiply by ``2^126``
        and one by the E8M0 scale ``2^(s - 127)``. INT4: ``0x4300 | nib`` is bf16 ``128 + nib``, minus 136 is
        ``nib - 8`` exactly, times the bf16 scale. Each product is rounded once to nearest even (bf16 keeps
        subnormals), the rounding of ``kimi_core.quant.dequantize``'s float32 product, so the weights are
        bit-exact. ``FMT_MXFP4_FOLDED``: ``scale2`` already holds ``2^126`` times the scale (:func:`scale_bits_to_pairs`),
        so one multiply, rounded once the same way."""
        if FMT != 1:
            u = pairs << 6
            bits = (u & 0x01C001C0) | ((u << 6) & -0x7FFF8000)  # 0x80008000: both sign bits
            if FMT == 0:
                return gl.inline_asm_elementwise(
                    "{ .reg .b32 c; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 $0, $1, c; mul.rn.bf16x2 $0, $0, $2; }",
                    "=r,r,r", [bits, scale2], dtype=gl.int32, is_pure=True, pack=1)
            else:
                return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, scale2],
                                                 dtype=gl.int32, is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 c; mov.b32 c, 0x43084308; sub.rn.bf16x2 $0, $1, c; mul.rn.bf16x2 $0, $0, $2; }",
                "=r,r,r", [pairs | 0x43004300, scale2], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def bf16_halves(pairs):
        """bf16 ``[..., 2]`` of int32 bf16x2 ``pairs`` (:func:`_bf16x2_decode`'s): element ``2j`` (low half) then
        ``2j + 1`` (high half) along a new last axis; the registers are the same, only relabelled."""
        lo = (pairs & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _scale_box(step, col0, DGRAD: gl.constexpr, BK: gl.constexpr, SB: gl.constexpr):
        """(first scale group of the 16-byte TMA box, byte offset of the step's groups inside it). TMA needs the
        innermost coordinate 16-byte aligned, so the box starts at the aligned group at or below the step's first
        (forward: group ``BK / 32 * step``; dgrad: ``col0 / 32``, the same every step)."""
        if DGRAD:
            g0 = col0 // 32
        else:
            g0 = step * (BK // 32)
        box0 = g0 // (16 // SB) * (16 // SB)
        return box0, (g0 - box0) * SB

    @gluon.jit
    def _pick_scale(words, cols, byte, MASK: gl.constexpr, WORD_SELECT: gl.constexpr = False):
        """``[R]`` int32: the scale at byte offset ``byte`` of each row of ``words`` (``[R, 4]`` int32 = the 16
        bytes of a row's TMA box, little-endian). ``WORD_SELECT``: the word by two selects on its (uniform) index
        instead of a masked sum over the four (fewer instructions, one more live register: the register forward
        with two programs per SM and decode ahead spills with it)."""
        if WORD_SELECT:
            even, odd = gl.split(gl.reshape(words, [words.shape[0], 2, 2]))  # words (0, 2) and (1, 3)
            w0, w2 = gl.split(even)
            w1, w3 = gl.split(odd)
            idx = byte // 4
            w = gl.where(idx >= 2, gl.where(idx % 2 == 1, w3, w2), gl.where(idx % 2 == 1, w1, w0))
        else:
            w = gl.sum(gl.where(gl.expand_dims(cols, 0) == byte // 4, words, 0), axis=1)
        return (w >> ((byte % 4) * 8)) & MASK

    @gluon.jit
    def _scale_pairs(s_tile, off, R: gl.constexpr, G: gl.constexpr, layout: gl.constexpr, FMT: gl.constexpr,
                     LW: gl.constexpr, WORD_SELECT: gl.constexpr = False):
        """int32 ``[R, G]`` bf16x2 pairs (the same scale in both halves), in ``layout``, of the ``G`` (2, 4 or 8) scale
        groups at byte ``off`` of each row of ``s_tile`` (``[R, 16 bytes]`` row-major: E8M0 bytes for MXFP4, bf16 for
        INT4; TMA zero-fills rows past the tensor). ``LW``: the layout the rows' four words are loaded in (each
        thread all four words of its rows); when its rows lie as ``layout``'s do, no data moves between threads."""
        SB: gl.constexpr = 2 if FMT == 1 else 1
        MASK: gl.constexpr = 0xFFFF if FMT == 1 else 0xFF
        words = s_tile._reinterpret(gl.int32, [R, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(LW)
        cols = gl.arange(0, 4, layout=gl.SliceLayout(0, LW))
        if G == 2:  # forward: the step's two groups lie in one word (MXFP4: off even; INT4: off % 4 == 0)
            w = _pick_scale(words, cols, off // 4 * 4, -1, WORD_SELECT)
            v = gl.join((w >> ((off % 4) * 8)) & MASK, (w >> ((off % 4 + SB) * 8)) & MASK)
        else:
            v0 = _pick_scale(words, cols, off, MASK)
            v1 = _pick_scale(words, cols, off + SB, MASK)
        if G > 2:  # G == 4: join(join(v0, v2), join(v1, v3))[r, i, k] = v[2 i + k]; G == 8 one level deeper
            v2 = _pick_scale(words, cols, off + 2 * SB, MASK)
            v3 = _pick_scale(words, cols, off + 3 * SB, MASK)
            if G == 4:
                v = gl.reshape(gl.join(gl.join(v0, v2), gl.join(v1, v3)), [R, 4])
            else:  # [r, i, j, k] = v[4 i + 2 j + k]
                v4 = _pick_scale(words, cols, off + 4 * SB, MASK)
                v5 = _pick_scale(words, cols, off + 5 * SB, MASK)
                v6 = _pick_scale(words, cols, off + 6 * SB, MASK)
                v7 = _pick_scale(words, cols, off + 7 * SB, MASK)
                v = gl.reshape(gl.join(gl.join(gl.join(v0, v4), gl.join(v2, v6)),
                                       gl.join(gl.join(v1, v5), gl.join(v3, v7))), [R, 8])
        return scale_bits_to_pairs(gl.convert_layout(v, layout), FMT)

    @gluon.jit
    def packed_scale_bits(packed, FMT: gl.constexpr):
        """int32 bf16x2 scale pairs of ``packed`` (int32: the raw scale bits of the low half in bits 0-15, of the high
        half in bits 16-31): MXFP4's E8M0 byte ``s`` -> bf16 ``2^(s - 127)`` = ``s << 7``, and ``s = 0`` the subnormal
        ``2^-127`` = ``0x40``, which is what an unsigned 16-bit maximum with ``0x40`` makes of both halves at once
        (``max.u16x2``, sm_90; every ``s >= 1`` gives ``0x80`` or more); ``FMT_MXFP4_FOLDED``: ``2^(s - 1)`` =
        ``(s + 126) << 7``, a normal bf16 for ``s <= 128``; INT4's bf16 bits as they are."""
        if FMT == 0:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 c; mov.b32 c, 0x00400040; max.u16x2 $0, $1, c; }", "=r,r", [packed << 7],
                dtype=gl.int32, is_pure=True, pack=1)
        elif FMT == 2:
            return (packed + 0x007E007E) << 7
        return packed

    @gluon.jit
    def scale_bits_to_pairs(sb, FMT: gl.constexpr):
        """int32 bf16x2 scale pairs, the same scale in both halves, of the raw scale bits ``sb``
        (:func:`packed_scale_bits`)."""
        return packed_scale_bits(sb | (sb << 16), FMT)

    @gluon.jit
    def _tile_at(tiles_ptr, t, n_col_tiles, BN: gl.constexpr):
        """Work item ``t`` -> (expert, first row, end row, first output column): the column tiles of one row tile
        are consecutive items, so the CTAs running at one time share their activation rows."""
        r = t // n_col_tiles
        expert = gl.load(tiles_ptr + r * 3)
        row0 = gl.load(tiles_ptr + r * 3 + 1)
        row_end = gl.load(tiles_ptr + r * 3 + 2)
        return expert, row0, row_end, (t - r * n_col_tiles) * BN

    @gluon.jit
    def _loader(a_desc, p_desc, s_desc, a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, tiles_ptr, n_tiles,
                n_col_tiles, N, KG, steps, DGRAD: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                LOAD_STAGES: gl.constexpr, SCALES_T: gl.constexpr):
        """One warp here (the default partition's four in :mod:`.gluon_w4a16_rs`; one thread issues each copy): TMA
        copies of the activation tile ``[BM, BK]``, the packed weight bytes and the scales of each
        step into the ``LOAD_STAGES``-deep load rings (forward: bytes ``[BN rows, BK / 2]``, scales of those rows;
        dgrad: bytes ``[BK rows, BN / 2]``, scales of those rows; ``SCALES_T``: dgrad with the scales transposed,
        ``[E * KG, N]`` with ``KG = K / 32`` groups per expert, a ``[BN / 32, BK]`` box of the tile's groups). The
        scales go by TMA, not by the decoder's own loads: its fence before each wgmma hand-off (``MEMBAR``) would
        wait for them. The rings run on across this
        program's work items (``it`` counts its K steps), so the next tile's first loads overlap this one's end."""
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            expert, row0, _, col0 = _tile_at(tiles_ptr, t, n_col_tiles, BN)
            for i in range(steps):
                s = it % LOAD_STAGES
                phase = ((it // LOAD_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
                mbarrier.wait(p_free.index(s), phase)
                P_BOXES: gl.constexpr = 2 if SCALES_T else 1
                mbarrier.expect(p_ready.index(s), P_BOXES * p_desc.block_type.nbytes + s_desc.block_type.nbytes)
                if SCALES_T:  # the bytes as two boxes, one per consumer warpgroup's half of the columns
                    tma.async_copy_global_to_shared(p_desc, [expert * N + i * BK, col0 // 2], p_ready.index(s),
                                                    p_ring.index(2 * s))
                    tma.async_copy_global_to_shared(p_desc, [expert * N + i * BK, col0 // 2 + BN // 4],
                                                    p_ready.index(s), p_ring.index(2 * s + 1))
                    tma.async_copy_global_to_shared(s_desc, [expert * KG + col0 // 32, i * BK], p_ready.index(s),
                                                    s_ring.index(s))
                else:
                    box0, _ = _scale_box(i, col0, DGRAD, BK, 16 // s_desc.block_type.shape[1])
                    if DGRAD:
                        tma.async_copy_global_to_shared(p_desc, [expert * N + i * BK, col0 // 2], p_ready.index(s),
                                                        p_ring.index(s))
                        tma.async_copy_global_to_shared(s_desc, [expert * N + i * BK, box0], p_ready.index(s),
                                                        s_ring.index(s))
                    else:
                        tma.async_copy_global_to_shared(p_desc, [expert * N + col0, i * (BK // 2)], p_ready.index(s),
                                                        p_ring.index(s))
                        tma.async_copy_global_to_shared(s_desc, [expert * N + col0, box0], p_ready.index(s),
                                                        s_ring.index(s))
                mbarrier.wait(a_free.index(s), phase)
                mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, i * BK], a_ready.index(s), a_ring.index(s))
                it += 1

    @gluon.jit
    def _decoder(p_ring, s_ring, w_ring, p_ready, p_free, w_ready, w_free, n_tiles, n_col_tiles, N, steps,
                 FMT: gl.constexpr,
                 DGRAD: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, LOAD_STAGES: gl.constexpr,
                 W_STAGES: gl.constexpr, DECODE_WARPS: gl.constexpr):
        """``DECODE_WARPS`` warps: packed bytes ``[R, C]`` of stage ``s`` (byte ``c`` = elements ``2c``, ``2c + 1``
        in its low / high nibble, MXFP4 and INT4 alike) of load stage ``i % LOAD_STAGES`` -> bf16 ``[R, 2C]`` weight
        tile in ``w_ring[i % W_STAGES]`` (``i`` counts this program's K steps over its work items)."""
        if DGRAD:  # W[step rows (n), output cols (k)]
            R: gl.constexpr = BK
            C: gl.constexpr = BN // 2
            L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [DECODE_WARPS, 1, 1], [2, 1, 0])
            L2: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [DECODE_WARPS, 1], [1, 0])
        else:  # W[output cols (n), step (k)]
            R: gl.constexpr = BN
            C: gl.constexpr = BK // 2
            L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [16, 2, 1], [DECODE_WARPS, 1, 1], [2, 1, 0])
            L2: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [DECODE_WARPS, 1], [1, 0])
        G: gl.constexpr = C // 16  # 32-element scale groups per tile row
        SL: gl.constexpr = gl.SliceLayout(2, L3)
        LW: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [DECODE_WARPS, 1], [1, 0])  # a row's scale words
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            col0 = (t % n_col_tiles) * BN
            for i in range(steps):
                s = it % LOAD_STAGES
                mbarrier.wait(p_ready.index(s), (it // LOAD_STAGES) & 1)
                b = p_ring.index(s).load(L2)
                _, off = _scale_box(i, col0, DGRAD, BK, 2 if FMT == 1 else 1)
                sc = _scale_pairs(s_ring.index(s), off, R, G, SL, FMT, LW)
                mbarrier.arrive(p_free.index(s), count=1)
                b = gl.convert_layout(gl.reshape(b.to(gl.int32) & 0xFF, [R, G, 16]), L3, assert_trivial=True)
                pairs = (b | (b << 12)) & 0x000F000F
                pairs = _bf16x2_decode(pairs, gl.expand_dims(sc, 2), FMT)
                if DGRAD:  # step rows past N belong to the next expert (or are TMA zero-fill): their weights are 0
                    n = i * BK + gl.arange(0, R, layout=gl.SliceLayout(1, SL))
                    pairs = gl.where(gl.expand_dims(gl.expand_dims(n < N, 1), 2), pairs, 0)
                w = gl.reshape(bf16_halves(pairs), [R, 2 * C])
                ws = it % W_STAGES
                mbarrier.wait(w_free.index(ws), ((it // W_STAGES) & 1) ^ 1)
                w_ring.index(ws).store(w)
                fence_async_shared()  # the generic-proxy stores before the async-proxy (wgmma) reads
                mbarrier.arrive(w_ready.index(ws), count=1)
                it += 1

    @gluon.jit
    def store_tile(acc, out_ptr, row0, row_end, col0, out_cols, stride_om, BN: gl.constexpr, BM: gl.constexpr):
        """Write the fp32 accumulator ``acc`` ``[BN output columns, BM rows]`` (wgmma layout, ``BN / 32`` warps) back
        transposed as bf16: ``out[row0 + j, col0 + i] = acc[i, j]`` for rows below ``row_end`` and columns below
        ``out_cols``, eight consecutive output columns per thread (one 16-byte store). ``BN`` 64 (one warpgroup of the
        128-column register-fragment kernel) spreads a column's 64 over 8 lanes instead of 16."""
        TN: gl.constexpr = 16 if BN >= 128 else BN // 8  # lanes along the output columns
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [TN, 32 // TN], [1, BN // 32 if BN >= 128 else 4], [0, 1])
        out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
        cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
        gl.store(out_ptr + rows.to(gl.int64)[None, :] * stride_om + cols[:, None], out,
                 mask=(cols < out_cols)[:, None] & (rows < row_end)[None, :])

    @gluon.jit
    def _consumer(a_ring, w_ring, a_ready, a_free, w_ready, w_free, out_ptr, tiles_ptr, n_tiles, n_col_tiles, steps,
                  out_cols, stride_om, DGRAD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  LOAD_STAGES: gl.constexpr, W_STAGES: gl.constexpr):
        """Default partition (one warpgroup per 128 of ``BN``): per work item, the transposed tile ``out^T [BN, BM] =
        W_tile . a_tile^T`` by wgmma with the weights as its M side (two m64 instructions per warpgroup) and the ``BM``
        activation rows as its N side
        (8 to 128), so a tile of a small expert reads only about the rows it has. A step's activation and weight
        stages are released (``a_free``, ``w_free``) once its wgmma has retired (the last step's after the final
        wait); then the masked bf16 epilogue writes the tile back transposed while loader and decoder already fill
        the rings for this program's next work item."""
        CW: gl.constexpr = BN // 32  # warps: one warpgroup per 128 weight rows
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                             instr_shape=[16, BM, 16])
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            _, row0, row_end, col0 = _tile_at(tiles_ptr, t, n_col_tiles, BN)
            acc = gl.zeros((BN, BM), dtype=gl.float32, layout=acc_layout)
            for i in range(steps):
                s = it % LOAD_STAGES
                ws = it % W_STAGES
                mbarrier.wait(a_ready.index(s), (it // LOAD_STAGES) & 1)
                mbarrier.wait(w_ready.index(ws), (it // W_STAGES) & 1)
                if DGRAD:  # W tile [BK (n), BN (k)] -> A operand [BN, BK]
                    acc = warpgroup_mma(w_ring.index(ws).permute((1, 0)), a_ring.index(s).permute((1, 0)), acc,
                                        is_async=True)
                else:  # W tile [BN (n), BK (k)]
                    acc = warpgroup_mma(w_ring.index(ws), a_ring.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step it - 1's wgmma has retired
                if i > 0:
                    mbarrier.arrive(a_free.index((it - 1) % LOAD_STAGES), count=1)
                    mbarrier.arrive(w_free.index((it - 1) % W_STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(a_free.index((it - 1) % LOAD_STAGES), count=1)
            mbarrier.arrive(w_free.index((it - 1) % W_STAGES), count=1)
            # the epilogue runs here (Triton 3.6's warp_specialize cannot return the default partition's tensors)
            store_tile(acc, out_ptr, row0, row_end, col0, out_cols, stride_om, BN, BM)

    @gluon.jit
    def load_rings(a_desc, p_desc, s_desc, LOAD_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                   P_PARTS: gl.constexpr):
        """The loader's ``LOAD_STAGES``-deep shared rings (activation tiles, packed bytes, scale boxes, in the blocks
        and layouts of the three TMA descriptors) and their barriers, initialised: ``a_ready`` / ``p_ready`` complete
        on the TMA bytes, ``a_free`` / ``p_free`` once ``CONSUMERS`` partitions have arrived. ``P_PARTS``: packed-byte
        boxes per stage (2: one per consumer warpgroup, stage ``s`` part ``h`` at ``p_ring.index(2 s + h)``)."""
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [LOAD_STAGES] + a_desc.block_type.shape, a_desc.layout)
        p_ring = gl.allocate_shared_memory(p_desc.dtype, [LOAD_STAGES * P_PARTS] + p_desc.block_type.shape,
                                           p_desc.layout)
        s_ring = gl.allocate_shared_memory(s_desc.dtype, [LOAD_STAGES] + s_desc.block_type.shape, s_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        a_free = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(LOAD_STAGES):
            mbarrier.init(a_ready.index(s), count=1)
            mbarrier.init(a_free.index(s), count=CONSUMERS)
            mbarrier.init(p_ready.index(s), count=1)
            mbarrier.init(p_free.index(s), count=CONSUMERS)
        return a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free

    @gluon.jit
    def w4a16_ws_kernel(a_desc, p_desc, s_desc, out_ptr, tiles_ptr, n_tiles, n_col_tiles, N, K, stride_om,
                        FMT: gl.constexpr, DGRAD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        BK: gl.constexpr, LOAD_STAGES: gl.constexpr, W_STAGES: gl.constexpr,
                        DECODE_WARPS: gl.constexpr, DECODE_REGS: gl.constexpr):
        """Forward (``a = x [T, K]``, ``out = y [T, N]``) or dgrad (``a = dy [T, N]``, ``out = dx [T, K]``) of
        the ``[BM, BN]`` output tiles ``t = program_id, program_id + programs, ...`` below ``n_tiles`` (``t`` = row
        tile ``t // n_col_tiles`` of the tile table, column tile ``t % n_col_tiles``): one per program, or, persistent,
        several with the rings running on between them. ``a_desc``: TMA descriptor of
        ``a`` with block ``[BM, BK]``; ``p_desc``: of the packed bytes as ``[E * N, K / 2]`` uint8 with block
        ``[BN, BK / 2]`` (dgrad ``[BK, BN / 2]``); ``s_desc``: of the scales as ``[E * N, K / 32]`` with block
        ``[BN, 16 bytes]`` (dgrad ``[BK, 16 bytes]``: TMA's narrowest row)."""
        if DGRAD:
            steps = gl.cdiv(N, BK)
            out_cols = K
            w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
            w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, BK, BN], w_layout)
        else:
            steps = K // BK
            out_cols = N
            w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
            w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, BN, BK], w_layout)
        a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free = load_rings(a_desc, p_desc, s_desc, LOAD_STAGES, 1, 1)
        w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
        w_free = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(W_STAGES):
            mbarrier.init(w_ready.index(s), count=1)
            mbarrier.init(w_free.index(s), count=1)

        gl.warp_specialize([
            (_consumer, (a_ring, w_ring, a_ready, a_free, w_ready, w_free, out_ptr, tiles_ptr, n_tiles, n_col_tiles,
                         steps, out_cols, stride_om, DGRAD, BM, BN, LOAD_STAGES, W_STAGES)),
            (_loader, (a_desc, p_desc, s_desc, a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, tiles_ptr,
                       n_tiles, n_col_tiles, N, K // 32, steps, DGRAD, BN, BK, LOAD_STAGES, False)),
            (_decoder, (p_ring, s_ring, w_ring, p_ready, p_free, w_ready, w_free, n_tiles, n_col_tiles, N, steps, FMT,
                        DGRAD, BN, BK, LOAD_STAGES, W_STAGES, DECODE_WARPS)),
        ], [1, DECODE_WARPS], [40, DECODE_REGS])


def descriptor_blocks(dgrad: bool, block_m: int = BM, scale_bytes: int = 1, block_n: int = BN,
                      scales_t: bool = False) -> tuple[list[int], list[int], list[int]]:
    """TMA block shapes: activation ``[block_m, BK]``; packed bytes ``[block_n, BK / 2]`` (dgrad ``[BK, block_n /
    2]``); scales ``[block_n, 16 / scale_bytes]`` (dgrad ``[BK, ..]``): 16 bytes per row, TMA's narrowest, of which a
    step uses ``BK / 32`` (dgrad ``block_n / 32``) groups; ``scales_t`` (dgrad of :mod:`.gluon_w4a16_rs`, scales
    transposed to ``[E * K / 32, N]``): ``[block_n / 32, BK]``, exactly the step's groups, and the bytes in two
    ``[BK, block_n / 4]`` boxes (a slice of one swizzled box along its rows is not allowed)."""
    rows = BK if dgrad else block_n
    if scales_t:  # and the bytes as two boxes per step, one per consumer warpgroup's half of the columns
        return [block_m, BK], [BK, block_n // 4], [block_n // 32, BK]
    return [block_m, BK], ([BK, block_n // 2] if dgrad else [block_n, BK // 2]), [rows, 16 // scale_bytes]


def scale_smem_layout(s_block: list[int], scale_bytes: int, scales_t: bool = False):
    """Shared-memory layout of a scale box: the default swizzle, or none for ``scales_t`` (each consumer
    warpgroup reads its own rows of the ``[block_n / 32, BK]`` box, a slice a swizzled box does not allow)."""
    if scales_t:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * scale_bytes, rank=2)
    return gl.NVMMASharedLayout.get_default_for(s_block, gl.uint8 if scale_bytes == 1 else gl.bfloat16)


def mxfp4_scales_fold(w_scale: torch.Tensor) -> bool:
    """Whether every E8M0 byte of ``w_scale`` (uint8, any shape) is at most 128 (scales up to 2, as in any real
    checkpoint: a weight up to 12), so ``2^(s - 1)`` is a normal bf16 and the decode can run as
    :data:`FMT_MXFP4_FOLDED`. Read once per tensor and version (one device sync), remembered on the tensor; while a
    CUDA graph is being captured (where a sync is illegal) an unread tensor answers False: the exact two-multiply
    decode, the same bits."""
    seen = getattr(w_scale, "_kimi_scales_fold", None)
    if seen is not None and seen[0] == w_scale._version:
        return seen[1]
    if w_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    fold = bool((w_scale <= 128).all())
    w_scale._kimi_scales_fold = (w_scale._version, fold)
    return fold


def kernel_fmt_id(fmt_id: int, w_scale: torch.Tensor, fold_scales: bool) -> int:
    """The format id a W4A16 kernel (Gluon or fused Triton) runs: :data:`FMT_MXFP4_FOLDED` where ``fold_scales`` asks
    for it, ``fmt_id`` is MXFP4's (0) and every scale byte allows it (:func:`mxfp4_scales_fold`), else ``fmt_id``
    (the two-multiply decode, exact for every scale; INT4 as it is)."""
    return FMT_MXFP4_FOLDED if fold_scales and fmt_id == 0 and mxfp4_scales_fold(w_scale) else fmt_id


def shape_fits(N: int, K: int, scale_bytes: int = 1) -> bool:
    """Whether the Gluon kernels take ``[N, K]`` experts whose scales have ``scale_bytes`` bytes (1: MXFP4's E8M0,
    the strictest; 2: INT4's bf16): ``K`` a multiple of :data:`BK`, 16-byte scale rows for TMA (``K`` a multiple of
    512 / ``scale_bytes``) and ``N`` a multiple of 8."""
    return not (K % BK or N % 8 or (K // 32 * scale_bytes) % 16)


def programs(n_tiles: int, persistent: bool | int, device) -> int:
    """Programs to launch for ``n_tiles`` work items: one each (``persistent=False``), one per SM (``True``: the
    rings and the partitions' registers fill an SM, so one program runs per SM either way), or that many (an
    ``int``, e.g. for tests whose few tiles would otherwise give each program one); never more than ``n_tiles``."""
    if persistent is False:
        return n_tiles
    if persistent is True:
        from kimi_core.kernels.triton_w4a16 import sm_count

        persistent = sm_count(device)
    if persistent < 1:
        raise ValueError(f"gluon_w4a16: persistent must be a bool or a positive number of programs, got {persistent}")
    return min(n_tiles, persistent)


@dataclasses.dataclass
class Launch:
    """What a Gluon W4A16 kernel is launched with, once the arguments are checked (:func:`prepare`): the output,
    the TMA descriptors of the activation, packed bytes and scales, the tile table and the work-item grid;
    no tile table (:attr:`empty`): nothing to compute (no rows or no output columns), ``out`` is returned as it is."""

    out: torch.Tensor
    descs: tuple = ()
    tiles: torch.Tensor | None = None
    n_tiles: int = 0
    n_col_tiles: int = 0
    N: int = 0
    K: int = 0
    block_m: int = BM
    stages: int = 2
    grid: tuple = (0,)
    fmt_id: int = 0

    @property
    def empty(self) -> bool:
        return self.tiles is None


def prepare(a, w_packed, w_scale, fmt: str, m_splits, out, dgrad: bool, where: str, block_m: int | None, block_n: int,
            stages: int | None, persistent: bool | int, stages_for,
            block_m_choices: tuple[int, ...] = BLOCK_M_CHOICES, scales_t: bool = False) -> Launch:
    """Check one call's arguments (``where`` names the entry point in errors: ``"gluon_w4a16.grouped_gemm"``) and
    build its :class:`Launch`; ``stages_for(block_m)`` is the kernel's default ring depth, ``block_m_choices`` the
    rows per tile it takes; ``scales_t`` (dgrad of :mod:`.gluon_w4a16_rs`): the scales go as a transposed copy
    ``[E * K / 32, N]`` (made here: 1/16 of the packed bytes)."""
    from kimi_core.kernels import _validate
    from kimi_core.kernels.triton_w4a16 import _fmt_id

    if not HAVE_GLUON:
        raise RuntimeError(f"{where} needs Triton >= 3.5 (triton.experimental.gluon)")
    E, N, K = _validate(a, "dy" if dgrad else "x", w_packed, w_scale, fmt, m_splits, "N" if dgrad else "K")
    scale_bytes = w_scale.element_size()
    if not shape_fits(N, K, scale_bytes):
        raise ValueError(f"{where}: needs K a multiple of {BK} and of {512 // scale_bytes} and N of 8 "
                         f"(TMA rows of 16 bytes for x, dy and the {fmt} scales), got K={K}, N={N}")
    block_m = pick_block_m(m_splits) if block_m is None else block_m
    if block_m not in block_m_choices:
        raise ValueError(f"{where}: block_m must be one of {block_m_choices}, got {block_m}")
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"{where}: block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")
    stages = stages_for(block_m) if stages is None else stages
    if not 2 <= stages <= MAX_LOAD_STAGES:
        raise ValueError(f"{where}: load_stages must be 2 to {MAX_LOAD_STAGES}, got {stages}")
    if a.device.type != "cuda":
        raise RuntimeError(f"{where}: runs on Hopper GPUs only (wgmma, TMA); {'dy' if dgrad else 'x'} is on "
                           f"{a.device}")
    if torch.cuda.get_device_capability(a.device)[0] != 9:
        raise RuntimeError(f"{where}: runs on Hopper GPUs only (wgmma, TMA); {a.device} has compute capability "
                           f"{torch.cuda.get_device_capability(a.device)}")
    out_cols = K if dgrad else N
    tiles = tile_table(m_splits, block_m, a.device)
    y = torch.empty((a.shape[0], out_cols), dtype=torch.bfloat16, device=a.device) if out is None else out
    if tiles.shape[0] == 0 or out_cols == 0:
        return Launch(out=y)
    a, w_scale = a.contiguous(), w_scale.contiguous()
    packed = w_packed.contiguous().view(torch.uint8).reshape(E * N, K // 2)  # INT4 words are the same bytes
    if scales_t:  # [E, N, K/32] -> [E, K/32, N]: each kw group's scales along n, one TMA box per step; rows
        # padded to 16 bytes for TMA, the box past N zero-filled (a finite scale: its weights meet dy's zero fill)
        from kimi_core.kernels.triton_transpose import transpose_last_two

        pad = -N % (16 // scale_bytes)
        scales = torch.empty((E * K // 32, N + pad), dtype=w_scale.dtype, device=a.device)[:, :N]
        transpose_last_two(w_scale.reshape(E, N, K // 32), scales.view(E, K // 32, N))  # tiled: coalesced both ways
    else:
        scales = w_scale.reshape(E * N, K // 32)
    a_block, p_block, s_block = descriptor_blocks(dgrad, block_m, scale_bytes, block_n, scales_t)
    descs = (TensorDescriptor.from_tensor(a, a_block, gl.NVMMASharedLayout.get_default_for(a_block, gl.bfloat16)),
             TensorDescriptor.from_tensor(packed, p_block, gl.NVMMASharedLayout.get_default_for(p_block, gl.uint8)),
             TensorDescriptor.from_tensor(scales, s_block, scale_smem_layout(s_block, scale_bytes, scales_t)))
    n_col_tiles = -(-out_cols // block_n)
    n_tiles = n_col_tiles * tiles.shape[0]
    return Launch(out=y, descs=descs, tiles=tiles, n_tiles=n_tiles, n_col_tiles=n_col_tiles, N=N, K=K,
                  block_m=block_m, stages=stages, grid=(programs(n_tiles, persistent, a.device),),
                  fmt_id=_fmt_id(fmt))


def _launch(a, w_packed, w_scale, fmt: str, m_splits, out, dgrad: bool, where: str, block_m: int | None,
            block_n: int, decode_warps: int, stages: int | None, persistent: bool | int) -> torch.Tensor:
    where = f"gluon_w4a16.{where}"
    if decode_warps not in (4, 8):
        raise ValueError(f"{where}: decode_warps must be 4 or 8, got {decode_warps}")
    if block_n == 256 and decode_warps != 4:
        raise ValueError(f"{where}: block_n=256 needs decode_warps=4 (two wgmma warpgroups leave too few registers "
                         f"for 8 decode warps), got {decode_warps}")
    run = prepare(a, w_packed, w_scale, fmt, m_splits, out, dgrad, where, block_m, block_n, stages, persistent,
                  lambda bm: default_load_stages(bm, dgrad, block_n))
    if run.empty:
        return run.out
    w4a16_ws_kernel[run.grid](*run.descs, run.out, run.tiles, run.n_tiles, run.n_col_tiles, run.N, run.K,
                              run.out.stride(0), run.fmt_id, dgrad, run.block_m, block_n, BK, run.stages,
                              w_stages(block_n), decode_warps, decode_regs(decode_warps, block_n),
                              num_warps=consumer_warps(block_n))
    return run.out


def grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                 out: torch.Tensor | None = None, block_m: int | None = None, block_n: int = BN,
                 decode_warps: int = DECODE_WARPS, load_stages: int | None = None,
                 persistent: bool | int = False) -> torch.Tensor:
    """``y[T, N]`` bf16, ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` with fp32 accumulation, for ``fmt`` one of
    :data:`kimi_core.kernels.MXFP4_FORMAT` / ``INT4_FORMAT`` (layouts in the module docstring; inputs checked as
    :func:`kimi_core.kernels.w4a16_grouped_gemm` checks them). Needs a Hopper GPU and Triton with Gluon; ``K`` a
    multiple of 64 (and of 512 for MXFP4 / 256 for INT4 scale rows); ``m_splits`` is read on the host; ``out``: a
    bf16 ``[T, N]`` to write into; ``block_m``: rows per tile, one of :data:`BLOCK_M_CHOICES` (default
    :func:`pick_block_m`); ``block_n``: output columns per tile, 128 (one wgmma warpgroup) or 256 (two, each
    activation tile then feeding twice the weight rows); ``decode_warps``: 4 or 8 warps decode the weights;
    ``load_stages``: TMA ring depth
    (default :func:`default_load_stages`); ``persistent``: one program per SM (or that many programs) walks the
    tiles, the rings running on from one tile to the next (:func:`programs`)."""
    return _launch(x, w_packed, w_scale, fmt, m_splits, out, False, "grouped_gemm", block_m, block_n, decode_warps,
                   load_stages, persistent)


def grouped_gemm_dgrad(dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                       out: torch.Tensor | None = None, block_m: int | None = None, block_n: int = BN,
                       decode_warps: int = DECODE_WARPS, load_stages: int | None = None,
                       persistent: bool | int = False) -> torch.Tensor:
    """``dx[T, K]`` bf16, ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` with fp32 accumulation (``dy`` bf16
    ``[T, N]``; otherwise as :func:`grouped_gemm`)."""
    return _launch(dy, w_packed, w_scale, fmt, m_splits, out, True, "grouped_gemm_dgrad", block_m, block_n,
                   decode_warps, load_stages, persistent)
