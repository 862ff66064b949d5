"""The Gluon building blocks of the W4A16 register kernels (:mod:`.register_kernel`): the exact bf16x2 decode of
4-bit codes, group scales read from their TMA boxes, the tile walk, the TMA loader partition, the shared-memory rings
and the epilogue store.

Decode arithmetic (bit for bit :func:`kimi_core.quant.dequantize`): two 4-bit codes become one bf16x2 pair with
integer ops and one or two ``mul.rn.bf16x2`` (MXFP4: E2M1 codes x E8M0 group scales; INT4: offset-binary nibbles x
bf16 group scales), each product rounded once to nearest even. Format ids as :mod:`kimi_core.kernels.w4a16.format_ids`.
"""

from __future__ import annotations

try:  # Triton >= 3.5 ships Gluon; older Tritons (and CPU-only installs) have no such module
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON"]

if HAVE_GLUON:

    @gluon.jit
    def bf16x2_decode(pairs, scale2, FMT: gl.constexpr):
        """int32 lanes of two 4-bit codes (``0x000c000c``-shaped: code of element ``2j`` in bits 0-3, of ``2j + 1``
        in bits 16-19) and a bf16x2 scale pair -> int32 holding the two dequantized bf16 (element ``2j`` low).

        MXFP4: the E2M1 code ``s|e e m`` placed as bf16 bits ``s << 15 | eem << 6`` is the code's value times
        ``2^-126`` (``e = 0`` lands on bf16 subnormals, exactly ``m/2 * 2^-126``); one bf16x2 multiply by ``2^126``
        and one by the E8M0 scale ``2^(s - 127)``. INT4: ``0x4300 | nib`` is bf16 ``128 + nib``, minus 136 is
        ``nib - 8`` exactly, times the bf16 scale. Each product is rounded once to nearest even (bf16 keeps
        subnormals), the rounding of ``kimi_core.quant.dequantize``'s float32 product, so the weights are
        bit-exact. ``FMT_MXFP4_FOLDED``: ``scale2`` already holds ``2^126`` times the scale
        (:func:`scale_bits_to_pairs`), so one multiply, rounded once the same way."""
        if FMT != 1:
            u = pairs << 6
            bits = (u & 0x01C001C0) | ((u << 6) & -0x7FFF8000)  # 0x80008000: both sign bits
            if FMT == 0:
                return gl.inline_asm_elementwise(
                    "{ .reg .b32 c; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 $0, $1, c; mul.rn.bf16x2 $0, $0, $2; }",
                    "=r,r,r",
                    [bits, scale2],
                    dtype=gl.int32,
                    is_pure=True,
                    pack=1,
                )
            else:
                return gl.inline_asm_elementwise(
                    "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, scale2], dtype=gl.int32, is_pure=True, pack=1
                )
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 c; mov.b32 c, 0x43084308; sub.rn.bf16x2 $0, $1, c; mul.rn.bf16x2 $0, $0, $2; }",
                "=r,r,r",
                [pairs | 0x43004300, scale2],
                dtype=gl.int32,
                is_pure=True,
                pack=1,
            )

    @gluon.jit
    def bf16_halves(pairs):
        """bf16 ``[..., 2]`` of int32 bf16x2 ``pairs`` (:func:`bf16x2_decode`'s): element ``2j`` (low half) then
        ``2j + 1`` (high half) along a new last axis; the registers are the same, only relabelled."""
        lo = (pairs & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def scale_box(step, BK: gl.constexpr, SB: gl.constexpr):
        """(first scale group of the forward's 16-byte TMA scale box at K step ``step``, byte offset of the step's
        groups inside it): TMA needs the innermost coordinate 16-byte aligned, so the box starts at the aligned group
        at or below the step's first (group ``BK / 32 * step``); ``SB`` bytes per scale."""
        g0 = step * (BK // 32)
        box0 = g0 // (16 // SB) * (16 // SB)
        return box0, (g0 - box0) * SB

    @gluon.jit
    def scale_pairs(
        s_tile, off, R: gl.constexpr, G: gl.constexpr, layout: gl.constexpr, FMT: gl.constexpr, LW: gl.constexpr
    ):
        """int32 ``[R, 2]`` bf16x2 pairs (the same scale in both halves), in ``layout``, of the forward step's ``G`` =
        2 scale groups at byte ``off`` of each row of ``s_tile`` (``[R, 16 bytes]`` row-major: E8M0 bytes for MXFP4,
        bf16 for INT4; TMA zero-fills rows past the tensor). The two groups lie in one word (MXFP4: ``off`` even;
        INT4: ``off % 4 == 0``), picked by two selects on its uniform index. ``LW``: the layout the rows' four words
        are loaded in (each thread all four words of its rows); when its rows lie as ``layout``'s do, no data moves
        between threads."""
        gl.static_assert(G == 2, "scale_pairs reads the forward step's two scale groups")
        SB: gl.constexpr = 2 if FMT == 1 else 1
        MASK: gl.constexpr = 0xFFFF if FMT == 1 else 0xFF
        words = s_tile._reinterpret(gl.int32, [R, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(LW)
        even, odd = gl.split(gl.reshape(words, [words.shape[0], 2, 2]))  # words (0, 2) and (1, 3)
        w0, w2 = gl.split(even)
        w1, w3 = gl.split(odd)
        idx = off // 4
        w = gl.where(idx >= 2, gl.where(idx % 2 == 1, w3, w2), gl.where(idx % 2 == 1, w1, w0))
        v = gl.join((w >> ((off % 4) * 8)) & MASK, (w >> ((off % 4 + SB) * 8)) & MASK)
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
                "{ .reg .b32 c; mov.b32 c, 0x00400040; max.u16x2 $0, $1, c; }",
                "=r,r",
                [packed << 7],
                dtype=gl.int32,
                is_pure=True,
                pack=1,
            )
        elif FMT == 2:
            return (packed + 0x007E007E) << 7
        return packed

    @gluon.jit
    def scale_bits_to_pairs(sb, FMT: gl.constexpr):
        """int32 bf16x2 scale pairs, the same scale in both halves, of the raw scale bits ``sb``
        (:func:`packed_scale_bits`)."""
        return packed_scale_bits(sb | (sb << 16), FMT)

    @gluon.jit
    def tile_at(tiles_ptr, t, n_col_tiles, BN: gl.constexpr):
        """Work item ``t`` -> (expert, first row, end row, first output column): the column tiles of one row tile
        are consecutive items, so the CTAs running at one time share their activation rows."""
        r = t // n_col_tiles
        expert = gl.load(tiles_ptr + r * 3)
        row0 = gl.load(tiles_ptr + r * 3 + 1)
        row_end = gl.load(tiles_ptr + r * 3 + 2)
        return expert, row0, row_end, (t - r * n_col_tiles) * BN

    @gluon.jit
    def loader(
        a_desc,
        p_desc,
        s_desc,
        a_ring,
        p_ring,
        s_ring,
        a_ready,
        a_free,
        p_ready,
        p_free,
        tiles_ptr,
        n_tiles,
        n_col_tiles,
        N,
        KG,
        steps,
        DGRAD: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        LOAD_STAGES: gl.constexpr,
    ):
        """The loader partition (one thread issues each copy): TMA copies of the activation tile ``[BM, BK]``, the
        packed weight bytes and the scales of each step into the ``LOAD_STAGES``-deep load rings (forward: bytes
        ``[BN rows, BK / 2]`` and the 16-byte scale boxes of those rows; dgrad: bytes ``[BK rows, BN / 2]`` as two
        boxes, one per consumer warpgroup's half of the columns, and the scales transposed, ``[E * KG, N]`` with
        ``KG = K / 32`` groups per expert, a ``[BN / 32, BK]`` box of the tile's groups). The rings run on across this program's work items (``it``
        counts its K steps), so the next tile's first loads overlap this one's end."""
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            expert, row0, _, col0 = tile_at(tiles_ptr, t, n_col_tiles, BN)
            for i in range(steps):
                s = it % LOAD_STAGES
                phase = ((it // LOAD_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
                mbarrier.wait(p_free.index(s), phase)
                P_BOXES: gl.constexpr = 2 if DGRAD else 1
                mbarrier.expect(p_ready.index(s), P_BOXES * p_desc.block_type.nbytes + s_desc.block_type.nbytes)
                if DGRAD:  # the bytes as two boxes, one per consumer warpgroup's half of the columns
                    tma.async_copy_global_to_shared(
                        p_desc, [expert * N + i * BK, col0 // 2], p_ready.index(s), p_ring.index(2 * s)
                    )
                    tma.async_copy_global_to_shared(
                        p_desc, [expert * N + i * BK, col0 // 2 + BN // 4], p_ready.index(s), p_ring.index(2 * s + 1)
                    )
                    tma.async_copy_global_to_shared(
                        s_desc, [expert * KG + col0 // 32, i * BK], p_ready.index(s), s_ring.index(s)
                    )
                else:
                    box0, _ = scale_box(i, BK, 16 // s_desc.block_type.shape[1])
                    tma.async_copy_global_to_shared(
                        p_desc, [expert * N + col0, i * (BK // 2)], p_ready.index(s), p_ring.index(s)
                    )
                    tma.async_copy_global_to_shared(
                        s_desc, [expert * N + col0, box0], p_ready.index(s), s_ring.index(s)
                    )
                mbarrier.wait(a_free.index(s), phase)
                mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, i * BK], a_ready.index(s), a_ring.index(s))
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
        gl.store(
            out_ptr + rows.to(gl.int64)[None, :] * stride_om + cols[:, None],
            out,
            mask=(cols < out_cols)[:, None] & (rows < row_end)[None, :],
        )

    @gluon.jit
    def load_rings(a_desc, p_desc, s_desc, LOAD_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, P_PARTS: gl.constexpr):
        """The loader's ``LOAD_STAGES``-deep shared rings (activation tiles, packed bytes, scale boxes, in the blocks
        and layouts of the three TMA descriptors) and their barriers, initialised: ``a_ready`` / ``p_ready`` complete
        on the TMA bytes, ``a_free`` / ``p_free`` once ``CONSUMERS`` partitions have arrived. ``P_PARTS``: packed-byte
        boxes per stage (2: one per consumer warpgroup, stage ``s`` part ``h`` at ``p_ring.index(2 s + h)``)."""
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [LOAD_STAGES] + a_desc.block_type.shape, a_desc.layout)
        p_ring = gl.allocate_shared_memory(
            p_desc.dtype, [LOAD_STAGES * P_PARTS] + p_desc.block_type.shape, p_desc.layout
        )
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
