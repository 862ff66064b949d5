"""The W4A16 grouped forward and dgrad in Gluon with the decoded weights in the wgmma's registers (Hopper).

Per work item (``BN`` output columns, 256 or 128, x up to ``BM`` rows of one expert), one CTA runs three
partitions handing stages of shared-memory rings to each other through mbarriers:

* the **loader** (:func:`.pipeline.loader`, 4 warps): TMA copies of the activation tile ``[BM, BK]`` and of the
  packed bytes and scale boxes of each K step into ``LOAD_STAGES`` rings;
* two **consumers** (one warpgroup each) own the tile's columns ``[0, R)`` and ``[R, 2 R)`` (``R = BN / 2``). Each
  reads its half of a step's packed bytes from shared memory straight into the wgmma A-fragment layout (a thread
  holds bytes ``c, c + 4, ..., c + 28`` of its rows, exactly the element pairs the fragment wants: the conversion is
  trivial, asserted at compile time), decodes them with :func:`.pipeline.bf16x2_decode`, runs its wgmma ("RS":
  A from registers) on the shared activation stage and waits for it before it decodes the next step into the same
  registers. While one warpgroup decodes, the other's wgmma runs, so the tensor cores stay busy as long as a decode
  takes no longer than a wgmma.

No decoded tile passes through shared memory, whose bandwidth would otherwise bound the MMA's pace. The decode, not
the tensor cores, sets the pace, so 128-column tiles take up to 256 rows (each decoded weight meets twice the rows)
and ``DECODE_AHEAD`` decodes step ``i + 1`` into a second fragment while step ``i``'s wgmma runs. The K loop is then
unrolled by two, the fragments ``w_a`` / ``w_b`` alternating: a loop-carried fragment would redefine registers an
in-flight wgmma reads, and ptxas would serialize every wgmma (C7513).

Dgrad runs the same consumer on ``W^T``: output columns (``K``) as the fragment's rows, the contraction over ``N``.
A byte's two nibbles are neighbouring output columns, which an m64 fragment would spread over threads; so the
fragment's rows are the output columns reordered (fragment row ``q + 8 h + 16 w`` = column ``2 q + h + 16 w``) and
put back before the store (:func:`_dgrad_rows`, a relabelling of registers). A fragment register holds one row at
contraction ``n`` and ``n + 1``, so the bytes of ``n`` and ``n + 1`` are decoded side by side in one word. The
scales vary along the contraction there, so they go as a transposed copy ``[E * K / 32, N]`` whose ``[BN / 32, 64]``
box holds exactly a step's groups.

``FMT_MXFP4_FOLDED``: where every E8M0 byte is at most 128, the decode's ``x 2^126`` is folded into the scale pair
(``2^(s - 1)``, a normal bf16), one multiply per decoded pair instead of two, rounded once as before.

Launch: :mod:`.launch`. Naive twin: :mod:`kimi_core.kernels.w4a16.naive`.
"""

from __future__ import annotations

from kimi_core.kernels.w4a16.gluon.pipeline import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from kimi_core.kernels.w4a16.gluon.pipeline import (
        bf16_halves,
        bf16x2_decode,
        load_rings,
        loader,
        packed_scale_bits,
        scale_box,
        scale_pairs,
        store_tile,
        tile_at,
    )

__all__ = ["HAVE_GLUON"]


if HAVE_GLUON:

    @gluon.jit
    def _fragment_bytes(p_tile, byte_layout: gl.constexpr, R: gl.constexpr, BK: gl.constexpr):
        """int32 ``[R, BK / 2]`` (values 0..255) in ``byte_layout`` (the wgmma A fragment's layout over packed bytes,
        one warpgroup, ``R`` = 64 or 128 weight rows, ``BK`` = 64) from the uint8 tile ``p_tile`` ``[R, BK / 2]`` in
        shared memory.

        A thread's bytes of one row are ``c, c + 4, ..., c + 28`` (``c`` = its lane mod 4): loaded one byte at a time
        that is 32 one-byte loads per step, 8 rows of 4 bytes per warp-wide load. Instead each thread loads its rows'
        whole 32 bytes as eight words (two 16-byte loads per row; the four lanes of a row read the same words, a
        broadcast) and picks its byte out of each word (``prmt``)."""
        gl.static_assert((R == 128 or R == 64) and BK == 64, "_fragment_bytes is laid out for 64 or 128 x 64 fragments")
        W: gl.constexpr = BK // 8  # words per row
        # [row, word, byte in word]: bytes of a word on lanes 0-1 (as the fragment has them), words in registers,
        # rows as the fragment's rows (lanes 2-4 -> rows 1, 2, 4; registers -> 8 (and 64); warps -> 16, 32)
        L3: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [8, 0, 0]] + ([[64, 0, 0]] if R == 128 else []),
            lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]],
            block_bases=[],
            shape=[R, W, 4],
        )
        layout: gl.constexpr = p_tile.type.layout
        words = p_tile._reinterpret(
            gl.int32,
            [R, W],
            gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=32, rank=2),
        ).load(gl.SliceLayout(2, L3))
        # PRMT byte c of each word into byte 0 of a zero word (selector nibbles c, 4, 4, 4: bytes 4-7 are the
        # zero operand's): one instruction where a shift and a mask were two
        sel = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))) | 0x4440
        w3, s3 = gl.broadcast(gl.expand_dims(words, 2), gl.expand_dims(gl.expand_dims(sel, 0), 0))
        b = gl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, $2;", "=r,r,r", [w3, s3], dtype=gl.int32, is_pure=True, pack=1
        )
        return gl.convert_layout(gl.reshape(b, [R, BK // 2]), byte_layout, assert_trivial=True)

    @gluon.jit
    def _decode(b, scale2, FMT: gl.constexpr, R: gl.constexpr, KC: gl.constexpr, acc_layout: gl.constexpr):
        """bf16 ``[R, KC]`` wgmma A fragment (``k_width`` 2 over ``acc_layout``) of the packed bytes ``b`` (int32,
        values 0..255, ``KC / 2`` bytes per row, in any shape whose row-major order is the row's bytes) and their
        bf16x2 scale pairs ``scale2`` (broadcastable to ``b``): :func:`.pipeline.bf16x2_decode` of each byte's
        two codes, low nibble first."""
        pairs = bf16x2_decode((b * 0x1001) & 0x000F000F, scale2, FMT)
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        return gl.convert_layout(gl.reshape(bf16_halves(pairs), [R, KC]), w_layout, assert_trivial=True)

    @gluon.jit
    def _step_operands(
        p_ring,
        s_ring,
        p_ready,
        p_free,
        s,
        phase,
        i,
        col0,
        HALF_INDEX: gl.constexpr,
        FMT: gl.constexpr,
        R: gl.constexpr,
        BK: gl.constexpr,
        byte_layout: gl.constexpr,
        SW: gl.constexpr,
    ):
        """This warpgroup's packed bytes (int32 ``[R, G, 16]``, ``G`` = ``BK / 32`` scale groups) and their bf16x2
        scale pairs (``[R, G]``) of K step ``i`` (ring stage ``s``, parity ``phase``) in the fragment's layout; arrives
        on ``p_free`` once they are in registers."""
        G: gl.constexpr = BK // 32
        SB: gl.constexpr = 2 if FMT == 1 else 1
        mbarrier.wait(p_ready.index(s), phase)
        b = gl.reshape(_fragment_bytes(p_ring.index(s).slice(HALF_INDEX * R, R), byte_layout, R, BK), [R, G, 16])
        _, off = scale_box(i, BK, SB)
        sc = scale_pairs(s_ring.index(s).slice(HALF_INDEX * R, R), off, R, G, gl.SliceLayout(2, b.type.layout), FMT, SW)
        mbarrier.arrive(p_free.index(s), count=1)
        return b, sc

    @gluon.jit
    def _step_fragment(
        p_ring,
        s_ring,
        p_ready,
        p_free,
        it,
        i,
        col0,
        HALF_INDEX: gl.constexpr,
        FMT: gl.constexpr,
        R: gl.constexpr,
        BK: gl.constexpr,
        LOAD_STAGES: gl.constexpr,
        byte_layout: gl.constexpr,
        SW: gl.constexpr,
        acc_layout: gl.constexpr,
        DGRAD: gl.constexpr,
    ):
        """The decoded bf16 A fragment ``[R, BK]`` of K step ``i`` (this program's ``it``-th ring use); ``DGRAD``:
        :func:`_dgrad_fragment`."""
        if DGRAD:
            w = _dgrad_fragment(p_ring, s_ring, p_ready, p_free, it, HALF_INDEX, FMT, R, BK, LOAD_STAGES, acc_layout)
        else:
            b, sc = _step_operands(
                p_ring,
                s_ring,
                p_ready,
                p_free,
                it % LOAD_STAGES,
                (it // LOAD_STAGES) & 1,
                i,
                col0,
                HALF_INDEX,
                FMT,
                R,
                BK,
                byte_layout,
                SW,
            )
            w = _decode(b, gl.expand_dims(sc, 2), FMT, R, BK, acc_layout)
        return w

    @gluon.constexpr_function
    def _dgrad_layout(R, BK, flat=False):
        """Where one dgrad warpgroup holds its weights ``[G, 16, BK]`` (scale group ``g`` of its ``R`` output
        columns, byte ``jj`` of the group's 16, contraction index ``n``): byte ``j = 16 g + jj`` holds the output
        columns ``2 j`` and ``2 j + 1``, and lies with the thread whose A-fragment rows are ``j``'s two rows of
        :func:`_dgrad_rows` (``j = q + 8 w + 32 x``: ``q`` = lane / 4, ``w`` = warp, ``x`` the second m64 block
        when ``R`` = 128); the thread's ``n`` are the fragment's columns (``2 (lane % 4) + {0, 1, 8, 9} + 16 s``).
        ``flat``: the same over ``[R / 2, BK]`` (byte ``j``, ``n``), the layout the bytes are loaded in."""
        reg = [[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 0, 32]] + ([[2, 0, 0]] if R == 128 else [])
        lane = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
        warp = [[0, 8, 0], [1, 0, 0]]
        shape = [R // 32, 16, BK]
        if flat:  # (g, jj, n) -> (16 g + jj, n)
            reg, lane, warp = ([[16 * g + jj, n] for g, jj, n in bases] for bases in (reg, lane, warp))
            shape = [R // 2, BK]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=shape)

    @gluon.jit
    def _dgrad_rows(t, R: gl.constexpr, G: gl.constexpr, TO_FRAGMENT: gl.constexpr):
        """Reorders the rows of ``t`` between output-column order and the A fragment's row order (no data moves:
        a relabelling of registers). A thread of the m64 fragment holds rows ``r`` and ``r + 8``; dgrad puts a
        byte's two output columns ``2 j``, ``2 j + 1`` (its two nibbles) there, so fragment row ``q + 8 h + 16 w + 64
        x`` is output column ``2 q + h + 16 w + 64 x``. ``TO_FRAGMENT``: ``t`` ``[G, 16, C, 2]`` (group, byte, column,
        nibble) -> ``[R, C]`` in fragment row order; else ``t`` ``[R, C]`` (fragment rows) -> ``[R, C]`` (output
        columns)."""
        if TO_FRAGMENT:  # (g, w0, q, c, h) -> (g, w0, h, q, c); g = w1 + 2 x
            C: gl.constexpr = t.shape[2]
            return gl.reshape(gl.permute(gl.reshape(t, [G, 2, 8, C, 2]), (0, 1, 4, 2, 3)), [R, C])
        else:  # (g, w0, h, q, c) -> (g, w0, q, h, c)
            C: gl.constexpr = t.shape[1]
            return gl.reshape(gl.permute(gl.reshape(t, [G, 2, 2, 8, C]), (0, 1, 3, 2, 4)), [R, C])

    @gluon.jit
    def _dgrad_scale_pairs(s_tile, layout: gl.constexpr, G: gl.constexpr, BK: gl.constexpr, FMT: gl.constexpr):
        """int32 bf16x2 scale pairs ``[G, BK / 2]`` in ``layout``: the scales of contraction rows ``2 i`` (low half)
        and ``2 i + 1`` (high half) of each of the warpgroup's ``G`` scale groups, read from the transposed scale box
        ``s_tile`` (``[G, BK]``, row-major, unswizzled) as one element of twice the scale's width: INT4's two bf16 are
        the pair as they lie; MXFP4's two E8M0 bytes are spread to bytes 0 and 2 (one ``prmt``) and converted by
        :func:`.pipeline.packed_scale_bits`."""
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if FMT == 1:
            return s_tile._reinterpret(gl.int32, [G, BK // 2], flat).load(layout)
        two = s_tile._reinterpret(gl.int16, [G, BK // 2], flat).load(layout).to(gl.int32)
        packed = gl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, 0x4140;", "=r,r", [two], dtype=gl.int32, is_pure=True, pack=1
        )
        return packed_scale_bits(packed, FMT)

    @gluon.jit
    def _dgrad_fragment(
        p_ring,
        s_ring,
        p_ready,
        p_free,
        it,
        HALF_INDEX: gl.constexpr,
        FMT: gl.constexpr,
        R: gl.constexpr,
        BK: gl.constexpr,
        LOAD_STAGES: gl.constexpr,
        acc_layout: gl.constexpr,
    ):
        """The decoded bf16 A fragment ``[R, BK]`` of one dgrad K step (this program's ``it``-th ring use) for the
        warpgroup's ``R`` output columns: ``W^T`` (output columns x contraction ``n``), rows in the order of
        :func:`_dgrad_rows`. Reads its half of the stage's packed bytes ``[BK (n), R / 2]`` (each thread its byte column
        ``j`` in its 16 rows ``n``) and the transposed scales ``[BN / 32, BK]`` (its group's row), arrives on
        ``p_free`` and decodes them with the scale of ``(n, group)`` (the same exact arithmetic as the forward):
        bytes ``n`` and ``n + 1`` (the thread's consecutive registers of :func:`_dgrad_layout`) as one word whose
        low nibbles are column ``2 j``'s fragment register and high nibbles column ``2 j + 1``'s."""
        s = it % LOAD_STAGES
        G: gl.constexpr = R // 32
        L3: gl.constexpr = _dgrad_layout(R, BK)
        mbarrier.wait(p_ready.index(s), (it // LOAD_STAGES) & 1)
        b = p_ring.index(2 * s + HALF_INDEX).permute((1, 0)).load(_dgrad_layout(R, BK, True)).to(gl.int32) & 0xFF
        b = gl.convert_layout(gl.reshape(b, [G, 16, BK]), L3, assert_trivial=True)
        # a fragment register holds one output column at contraction n and n + 1 (the thread's registers 0 / 1 of
        # L3): bytes n and n + 1 side by side in one word ([G, 16, BK / 2]), so its low nibbles decode straight to
        # column 2 j's register and its high nibbles to column 2 j + 1's, each half with its own n's scale
        b_n, b_n1 = gl.split(gl.reshape(b, [G, 16, BK // 2, 2]))
        words = b_n | (b_n1 << 16)
        scale2 = gl.expand_dims(
            _dgrad_scale_pairs(
                s_ring.index(s).slice(HALF_INDEX * G, G, dim=0), gl.SliceLayout(1, words.type.layout), G, BK, FMT
            ),
            1,
        )
        mbarrier.arrive(p_free.index(s), count=1)
        low = bf16x2_decode(words & 0x000F000F, scale2, FMT)
        high = bf16x2_decode((words >> 4) & 0x000F000F, scale2, FMT)
        cols = gl.join(gl.reshape(bf16_halves(low), [G, 16, BK]), gl.reshape(bf16_halves(high), [G, 16, BK]))
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        return gl.convert_layout(_dgrad_rows(cols, R, G, True), w_layout, assert_trivial=True)

    @gluon.jit
    def _issue(w, acc, a_ring, a_ready, it, LOAD_STAGES: gl.constexpr):
        """Waits for the ``it``-th activation stage and issues ``acc += w . a_tile^T`` as an async wgmma."""
        s = it % LOAD_STAGES
        mbarrier.wait(a_ready.index(s), (it // LOAD_STAGES) & 1)
        return warpgroup_mma(w, a_ring.index(s).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _rs_consumer(
        a_ring,
        p_ring,
        s_ring,
        a_ready,
        a_free,
        p_ready,
        p_free,
        out_ptr,
        tiles_ptr,
        n_tiles,
        n_col_tiles,
        steps,
        out_cols,
        stride_om,
        HALF_INDEX: gl.constexpr,
        FMT: gl.constexpr,
        BM: gl.constexpr,
        BK: gl.constexpr,
        LOAD_STAGES: gl.constexpr,
        R: gl.constexpr,
        DECODE_AHEAD: gl.constexpr,
        DGRAD: gl.constexpr,
    ):
        """One warpgroup: columns ``[R HALF_INDEX, R HALF_INDEX + R)`` of every ``2 R``-column work item (``R`` = 128
        or 64), ``out^T [R, BM] = W_half . a_tile^T`` with the weight half decoded into the wgmma's register A
        fragment each K step (see the module docstring). Arrives on ``p_free`` once it has read a step's bytes and
        scales and on ``a_free`` once its wgmma retired (both barriers count the two warpgroups). ``DECODE_AHEAD``:
        step ``i + 1``'s fragment is decoded (into its own registers) while step ``i``'s wgmma runs. ``DGRAD``: the
        columns are ``dx``'s (``K``), the K steps run over ``N`` and the fragment is :func:`_dgrad_fragment`'s, its
        rows put back in column order (:func:`_dgrad_rows`) before the store."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
        )
        byte_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
        # a row's four scale words in the registers of the threads that hold the row in the fragment
        SW: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]] + ([[64, 0]] if R == 128 else []),
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[R, 4],
        )
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            _, row0, row_end, col0 = tile_at(tiles_ptr, t, n_col_tiles, 2 * R)
            acc = gl.zeros((R, BM), dtype=gl.float32, layout=acc_layout)
            if DECODE_AHEAD:
                # software pipeline, unrolled by two so that no fragment is redefined while a wgmma reading it runs
                # (a loop-carried fragment would be: ptxas then serializes every wgmma, C7513): step i + 1 is decoded
                # into the other fragment while step i's wgmma runs
                w_a = _step_fragment(
                    p_ring,
                    s_ring,
                    p_ready,
                    p_free,
                    it,
                    0,
                    col0,
                    HALF_INDEX,
                    FMT,
                    R,
                    BK,
                    LOAD_STAGES,
                    byte_layout,
                    SW,
                    acc_layout,
                    DGRAD,
                )
                for j in range((steps - 1) // 2):  # steps 2 j and 2 j + 1; decodes 2 j + 1 and 2 j + 2
                    acc = _issue(w_a, acc, a_ring, a_ready, it, LOAD_STAGES)
                    w_b = _step_fragment(
                        p_ring,
                        s_ring,
                        p_ready,
                        p_free,
                        it + 1,
                        2 * j + 1,
                        col0,
                        HALF_INDEX,
                        FMT,
                        R,
                        BK,
                        LOAD_STAGES,
                        byte_layout,
                        SW,
                        acc_layout,
                        DGRAD,
                    )
                    acc, w_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_a))
                    mbarrier.arrive(a_free.index(it % LOAD_STAGES), count=1)
                    acc = _issue(w_b, acc, a_ring, a_ready, it + 1, LOAD_STAGES)
                    w_a = _step_fragment(
                        p_ring,
                        s_ring,
                        p_ready,
                        p_free,
                        it + 2,
                        2 * j + 2,
                        col0,
                        HALF_INDEX,
                        FMT,
                        R,
                        BK,
                        LOAD_STAGES,
                        byte_layout,
                        SW,
                        acc_layout,
                        DGRAD,
                    )
                    acc, w_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_b))
                    mbarrier.arrive(a_free.index((it + 1) % LOAD_STAGES), count=1)
                    it += 2
                # the last two steps (even steps: the forward's K is a multiple of 256; dgrad's N / 64 may be odd:
                # then only the last step, decoded in the loop)
                if steps % 2 == 0:
                    acc = _issue(w_a, acc, a_ring, a_ready, it, LOAD_STAGES)
                    w_b = _step_fragment(
                        p_ring,
                        s_ring,
                        p_ready,
                        p_free,
                        it + 1,
                        steps - 1,
                        col0,
                        HALF_INDEX,
                        FMT,
                        R,
                        BK,
                        LOAD_STAGES,
                        byte_layout,
                        SW,
                        acc_layout,
                        DGRAD,
                    )
                    acc, w_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_a))
                    mbarrier.arrive(a_free.index(it % LOAD_STAGES), count=1)
                    acc = _issue(w_b, acc, a_ring, a_ready, it + 1, LOAD_STAGES)
                    acc, w_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_b))
                    mbarrier.arrive(a_free.index((it + 1) % LOAD_STAGES), count=1)
                    it += 2
                else:
                    acc = _issue(w_a, acc, a_ring, a_ready, it, LOAD_STAGES)
                    acc, w_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_a))
                    mbarrier.arrive(a_free.index(it % LOAD_STAGES), count=1)
                    it += 1
            else:
                for i in range(steps):
                    s = it % LOAD_STAGES
                    w = _step_fragment(
                        p_ring,
                        s_ring,
                        p_ready,
                        p_free,
                        it,
                        i,
                        col0,
                        HALF_INDEX,
                        FMT,
                        R,
                        BK,
                        LOAD_STAGES,
                        byte_layout,
                        SW,
                        acc_layout,
                        DGRAD,
                    )
                    acc = _issue(w, acc, a_ring, a_ready, it, LOAD_STAGES)
                    acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))  # before w's registers are reused
                    mbarrier.arrive(a_free.index(s), count=1)
                    it += 1
            if DGRAD:
                acc = _dgrad_rows(acc, R, R // 32, False)
            store_tile(acc, out_ptr, row0, row_end, col0 + HALF_INDEX * R, out_cols, stride_om, R, BM)

    @gluon.jit
    def w4a16_rs_kernel(
        a_desc,
        p_desc,
        s_desc,
        out_ptr,
        tiles_ptr,
        tile_count_ptr,
        n_tiles,
        n_col_tiles,
        N,
        K,
        stride_om,
        FMT: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        LOAD_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        DECODE_AHEAD: gl.constexpr,
        DGRAD: gl.constexpr,
        COUNT_ON_DEVICE: gl.constexpr,
    ):
        """Forward ``y [T, N] = x . dequant(W)^T`` or (``DGRAD``) ``dx [T, K] = dy . dequant(W)`` over the
        ``BN``-column work items (``BN`` = 256 or 128, half per consumer warpgroup) ``t = program_id, program_id +
        programs, ...`` below ``n_tiles`` (``t`` = row tile ``t // n_col_tiles`` of the tile table, column tile ``t %
        n_col_tiles``); TMA descriptors of the activation, packed bytes and scales in the blocks of
        :func:`.launch.descriptor_blocks`. ``COUNT_ON_DEVICE`` (device splits): the table holds ``tile_count_ptr[0]``
        row tiles (written on the GPU, :mod:`.device_tiles`) and ``n_tiles`` only bounds the grid; the work items are
        that count times ``n_col_tiles``, so the programs past them do nothing."""
        if COUNT_ON_DEVICE:
            n_tiles = gl.load(tile_count_ptr) * n_col_tiles
        if DGRAD:  # the last step's rows past N: dy's TMA zero fill times finite weights (zero-filled scales)
            steps = gl.cdiv(N, BK)
            out_cols = K
        else:
            steps = K // BK
            out_cols = N
        # a_free / p_free count both consumer warpgroups
        a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free = load_rings(
            a_desc, p_desc, s_desc, LOAD_STAGES, 2, 2 if DGRAD else 1
        )
        R: gl.constexpr = BN // 2
        FIRST: gl.constexpr = 0
        SECOND: gl.constexpr = 1
        gl.warp_specialize(
            [
                (
                    loader,
                    (
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
                        K // 32,
                        steps,
                        DGRAD,
                        BN,
                        BK,
                        LOAD_STAGES,
                    ),
                ),
                (
                    _rs_consumer,
                    (
                        a_ring,
                        p_ring,
                        s_ring,
                        a_ready,
                        a_free,
                        p_ready,
                        p_free,
                        out_ptr,
                        tiles_ptr,
                        n_tiles,
                        n_col_tiles,
                        steps,
                        out_cols,
                        stride_om,
                        FIRST,
                        FMT,
                        BM,
                        BK,
                        LOAD_STAGES,
                        R,
                        DECODE_AHEAD,
                        DGRAD,
                    ),
                ),
                (
                    _rs_consumer,
                    (
                        a_ring,
                        p_ring,
                        s_ring,
                        a_ready,
                        a_free,
                        p_ready,
                        p_free,
                        out_ptr,
                        tiles_ptr,
                        n_tiles,
                        n_col_tiles,
                        steps,
                        out_cols,
                        stride_om,
                        SECOND,
                        FMT,
                        BM,
                        BK,
                        LOAD_STAGES,
                        R,
                        DECODE_AHEAD,
                        DGRAD,
                    ),
                ),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )
