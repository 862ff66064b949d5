"""The W4A16 grouped forward and dgrad in Gluon with the decoded weights in registers (issue #21).

:mod:`.gluon_w4a16` decodes each weight tile in its own warps into shared memory, from where the wgmma reads it
again: per 64-wide K step of a 128 x 128 tile that is 16 KB written and 16 KB read beside the 22 KB the TMA brings
and the 32 KB the wgmma reads of the activation tile, near the SM's 128 bytes per cycle of shared-memory bandwidth
at the MMA's pace. Here the wgmma's A operand (the weights, its M side) comes from registers instead ("RS" wgmma),
in a ``BN``-column tile (256 or 128) split between two warpgroups that take turns on the tensor cores:

* the **loader** (the default partition, 4 warps) is :func:`.gluon_w4a16._loader`: TMA copies of the activation
  tile ``[BM, BK]`` and of the packed bytes ``[BN, BK / 2]`` and 16-byte scale boxes ``[BN, 16 B]`` of each K step
  into ``LOAD_STAGES`` rings;
* two **consumers** (worker partitions, one warpgroup each) own the tile's columns ``[0, R)`` and ``[R, 2 R)``
  (``R = BN / 2``). Each reads its half of step ``i``'s packed bytes from shared memory straight into the wgmma
  A-fragment layout (a thread holds bytes ``c, c + 4, ..., c + 28`` of its rows, exactly the element pairs
  ``2c, 2c + 1`` the fragment wants: the conversion is trivial, asserted at compile time; the bytes come as 16-byte
  loads, :func:`_fragment_bytes`), decodes them with :func:`.gluon_w4a16._bf16x2_decode` (the exact arithmetic of
  :func:`kimi_core.quant.dequantize`), runs its wgmma on the shared activation stage and waits for it before it
  decodes the next step into the same registers (an in-flight wgmma reads its A registers; nothing else keeps them
  from being overwritten). While one warpgroup decodes, the other's wgmma runs, so the tensor cores stay busy as
  long as a decode takes no longer than a wgmma.

Tiles: 256 columns x up to 128 rows, or 128 columns x up to 256 rows (:func:`pick_block_n`): the same 128 fp32
accumulator registers per thread, but each decoded weight meets 256 rows, half the decode per multiply-add. The SASS
shows why that matters: the decode, not the tensor cores, sets the pace (a 256 x 128 MXFP4 step issues ~350
instructions per warp for 1 M multiply-adds, ~700 per scheduler per 1024-cycle step of both warpgroups; 128 x 256:
~200). Two ways to overlap a warpgroup's own decode with its own wgmma:

* ``decode_ahead``: step ``i + 1`` is decoded into a second fragment while step ``i``'s wgmma runs (128-column
  tiles: two 64-row fragments fit the registers). Written as a loop-carried fragment, the loop's phi redefines
  registers an in-flight wgmma reads and ptxas serializes every wgmma (C7513, "non wgmma instructions defining
  input registers of a wgmma between start and end of the pipeline stage"); so the K loop is unrolled by two, the
  fragments ``w_a`` / ``w_b`` alternating, and ptxas keeps the wgmmas asynchronous (the compile check asserts it
  for every variant). An earlier note here blamed the 168-register launch bound (C7512); that was wrong: after
  ``setmaxnreg`` the consumers use registers above 168.
* ``mma_chunks`` 2 or 4: the step in K slices, each slice's wgmma issued once its slice is decoded. It compiles
  without serialization, but the SASS has nearly all the slices' decode ahead of the first wgmma (LLVM's schedule),
  so little overlaps; measured within +-5% of one wgmma per step. Decode ahead measured 3-10 % faster on
  128-column tiles (H100, 2026-12-05); ``decode_ahead="auto"`` takes it wherever it fits.

Dgrad (:func:`grouped_gemm_dgrad`) runs the same consumer on ``W^T``: output columns (``K``) as the fragment's
rows, the contraction over ``N``. A byte's two nibbles are neighbouring output columns, which an m64 fragment would
spread over threads; so the fragment's rows are the output columns reordered (fragment row ``q + 8 h + 16 w`` =
column ``2 q + h + 16 w``: rows ``r`` and ``r + 8`` of one thread are the two nibbles of one byte), each thread
loads whole bytes of its 16 contraction rows per step and the accumulator's rows are put back before the store
(:func:`_dgrad_rows`, a relabelling of registers). A fragment register holds one row at contraction ``n`` and ``n +
1``, so the bytes of ``n`` and ``n + 1`` are decoded side by side in one word, low nibbles into one column's register
and high nibbles into the next column's, each half with its own ``n``'s scale (no bf16 halves repacked: 430 / 290
SASS instructions per two K steps for MXFP4 / INT4 where a byte per register took 494 / 386; INT4 dgrad 7.5-14 %
faster, MXFP4 0-7 %, H100, benchmarks/RESULTS.md 2026-12-06). The scales vary along the contraction there, so they
go as a transposed copy ``[E * K / 32, N]`` (made per call by :mod:`.triton_transpose`, 1/16 of the packed bytes) whose
``[BN / 32, 64]`` box holds exactly a step's groups. Shapes, dtypes, tile table, persistence and argument checks
as :mod:`.gluon_w4a16` (``x`` bf16 ``[T, K]``, ``y`` bf16 ``[T, N]``; dgrad ``dy`` ``[T, N]`` -> ``dx`` ``[T,
K]``). Extra memory: none beyond the output and the tile table (dgrad: and the transposed scales).

``fold_scales`` (MXFP4): where every E8M0 byte is at most 128 (any real checkpoint), the decode's ``x 2^126`` is
folded into the scale pair (``2^(s - 1)``, a normal bf16), one multiply per decoded pair instead of two, rounded
once as before (:data:`.gluon_w4a16.FMT_MXFP4_FOLDED`); the K loop's SASS per two steps: forward 370 -> 346, dgrad 382 ->
334. Measured on the H100 (2026-12-06, before / after in one process, bitwise equal): MXFP4 3-9 % faster at 512 / 2048
tokens per expert, forward and dgrad, so :data:`kimi_core.kernels.GLUON_OPTIONS` turns it on.

Status (2026-12-05): measured on the H200 and H100 (benchmarks/RESULTS.md, "W4A16 grouped GEMM: the Gluon kernels"
and "the register-fragment dgrad and decode ahead"); :func:`kimi_core.kernels.choose_path` picks both entry points
where :data:`kimi_core.kernels.W4A16_GLUON` says.
"""

from __future__ import annotations

import torch

from kimi_core.kernels import gluon_w4a16 as ws
from kimi_core.kernels.gluon_w4a16 import BK, HAVE_GLUON, MAX_LOAD_STAGES, RING_BUDGET

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

__all__ = ["BLOCK_N_CHOICES", "DEFAULT_MMA_CHUNKS", "MMA_CHUNK_CHOICES", "TWO_PER_SM", "ahead_where_it_fits",
           "block_m_choices", "default_load_stages", "fmt_id", "grouped_gemm", "grouped_gemm_dgrad", "pick_block_m", "pick_block_n"]


BLOCK_N_CHOICES = (128, 256)  # output columns per tile: two warpgroups of 64 or of 128 weight rows (the wgmma's M)
CONSUMER_REGS = 232  # per thread of each consumer warpgroup: 128 accumulator registers, the fragment, the decode
# two programs per SM (few rows per tile: small accumulators): 80 registers per thread at launch (2 x 384 threads
# x 80 fit the SM's 64 K), of which the loader warps give back to 32 and the consumers take 104; rings in half the
# shared memory; tiles of at most 64 x 128 or 32 x 256 (rows x columns: larger ones spill at 104 registers)
TWO_PER_SM = {"maxnreg": 80, "consumer_regs": 104, "ring_budget": 96 * 1024, "max_tile": 64 * 128}
MMA_CHUNK_CHOICES = (1, 2, 4)  # wgmmas per 64-wide K step: one, or one per 32- / 16-wide K slice
DEFAULT_MMA_CHUNKS = 1


def block_m_choices(block_n: int) -> tuple[int, ...]:
    """Activation rows per tile (the wgmma's N side) with ``block_n`` output columns: up to 128 with 256 columns
    (a warpgroup's ``[128, 128]`` fp32 accumulator is 128 registers per thread), up to 256 with 128 columns
    (``[64, 256]``, the same 128 registers). 256 rows halve the decode per multiply-add: each decoded weight meets
    256 rows instead of 128."""
    return ws.BLOCK_M_CHOICES + ((256,) if block_n == 128 else ())


def pick_block_n(m_splits) -> int:
    """Output columns per tile: 128 (then 256 rows per tile, :func:`pick_block_m`) where the non-empty experts' mean
    rows exceed 128, else 256. Measured on the H200 (benchmarks/RESULTS.md, 2026-12-04): 128 x 256 tiles are the
    faster at 512 and 2048 tokens per expert on every shape (K3 fc1 MXFP4 2048: 17.2 vs 21.4 ms), 256 x 128 at
    128 and below (K3 fc1 MXFP4 128: 1.37 vs 1.83 ms)."""
    return 128 if ws.mean_rows(m_splits) > ws.BM else 256


def pick_block_m(m_splits, block_n: int) -> int:
    """:func:`.gluon_w4a16.pick_block_m`, and 256 with ``block_n`` 128 where the non-empty experts' mean rows
    exceed 128."""
    if block_n == 128 and ws.mean_rows(m_splits) > ws.BM:
        return 256
    return ws.pick_block_m(m_splits)


def ahead_where_it_fits(block_n: int, mma_chunks: int = DEFAULT_MMA_CHUNKS, ctas_per_sm: int = 1) -> bool:
    """``decode_ahead="auto"``: decode ahead wherever it compiles, i.e. 128-column tiles with one wgmma per K step
    (two fragments in registers; one program per SM). Measured (benchmarks/RESULTS.md, H100, 2026-12-05): on
    128-column tiles it is the faster at 512 and 2048 tokens per expert on every shape, forward 3-10 %, dgrad
    likewise; 256-column tiles (the pick at 128 tokens and below) have no room for a second fragment."""
    return block_n == 128 and mma_chunks == 1 and ctas_per_sm == 1


def _resolve_columns(where: str, m_splits, block_n: int | None, decode_ahead: bool | str,
                    mma_chunks: int = DEFAULT_MMA_CHUNKS, ctas_per_sm: int = 1) -> tuple[int, bool]:
    """``(block_n, decode_ahead)`` of one call: ``decode_ahead="auto"`` -> :func:`ahead_where_it_fits` on the
    columns asked for or picked (:func:`pick_block_n`); ``block_n`` None -> 128 under decode ahead, else
    :func:`pick_block_n`; a ``block_n`` not in :data:`BLOCK_N_CHOICES` is refused by name (``where``)."""
    if decode_ahead == "auto":
        block_n = pick_block_n(m_splits) if block_n is None else block_n
        decode_ahead = ahead_where_it_fits(block_n, mma_chunks, ctas_per_sm)
    block_n = (128 if decode_ahead else pick_block_n(m_splits)) if block_n is None else block_n
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"{where}: block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")
    return block_n, bool(decode_ahead)


def default_load_stages(block_m: int, block_n: int, ctas_per_sm: int = 1, dgrad: bool = False) -> int:
    """Depth of the TMA rings (2 to :data:`MAX_LOAD_STAGES`): with no decoded-tile ring, as many stages of
    activation tile, packed bytes and scale box of a ``block_n``-column tile as fit :data:`RING_BUDGET` (with two
    programs per SM, ``TWO_PER_SM["ring_budget"]``); ``dgrad``: the dgrad stages (transposed scales)."""
    budget = RING_BUDGET if ctas_per_sm == 1 else TWO_PER_SM["ring_budget"]
    return max(2, min(MAX_LOAD_STAGES, budget // ws.load_stage_bytes(block_m, dgrad, block_n, scales_t=dgrad)))


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
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[R, W, 4])
        layout: gl.constexpr = p_tile.type.layout
        words = p_tile._reinterpret(gl.int32, [R, W], gl.NVMMASharedLayout(
            swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=32, rank=2)).load(gl.SliceLayout(2, L3))
        # PRMT byte c of each word into byte 0 of a zero word (selector nibbles c, 4, 4, 4: bytes 4-7 are the
        # zero operand's): one instruction where a shift and a mask were two
        sel = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))) | 0x4440
        w3, s3 = gl.broadcast(gl.expand_dims(words, 2), gl.expand_dims(gl.expand_dims(sel, 0), 0))
        b = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [w3, s3], dtype=gl.int32, is_pure=True,
                                      pack=1)
        return gl.convert_layout(gl.reshape(b, [R, BK // 2]), byte_layout, assert_trivial=True)

    @gluon.jit
    def _decode(b, scale2, FMT: gl.constexpr, R: gl.constexpr, KC: gl.constexpr, acc_layout: gl.constexpr):
        """bf16 ``[R, KC]`` wgmma A fragment (``k_width`` 2 over ``acc_layout``) of the packed bytes ``b`` (int32,
        values 0..255, ``KC / 2`` bytes per row, in any shape whose row-major order is the row's bytes) and their
        bf16x2 scale pairs ``scale2`` (broadcastable to ``b``): :func:`.gluon_w4a16._bf16x2_decode` of each byte's
        two codes, low nibble first."""
        pairs = ws._bf16x2_decode((b * 0x1001) & 0x000F000F, scale2, FMT)
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        return gl.convert_layout(gl.reshape(ws.bf16_halves(pairs), [R, KC]), w_layout, assert_trivial=True)

    @gluon.jit
    def _quarters(t, R: gl.constexpr):
        """The four 8-byte K slices of ``t`` ``[R, 2, 16]`` (scale group, byte): ``(group 0 bytes 0-7, group 1 bytes
        0-7, group 0 bytes 8-15, group 1 bytes 8-15)``, each ``[R, 8]``; the slices lie in registers, so no data
        moves."""
        lower, upper = gl.split(gl.permute(gl.reshape(t, [R, 2, 2, 8]), (0, 3, 1, 2)))  # by the half of a group
        g0_lo, g1_lo = gl.split(lower)
        g0_hi, g1_hi = gl.split(upper)
        return g0_lo, g1_lo, g0_hi, g1_hi

    @gluon.jit
    def _step_operands(p_ring, s_ring, p_ready, p_free, s, phase, i, col0, HALF_INDEX: gl.constexpr,
                       FMT: gl.constexpr, R: gl.constexpr, BK: gl.constexpr, byte_layout: gl.constexpr,
                       SW: gl.constexpr, WORD_SELECT: gl.constexpr):
        """This warpgroup's packed bytes (int32 ``[R, G, 16]``, ``G`` = ``BK / 32`` scale groups) and their bf16x2
        scale pairs (``[R, G]``) of K step ``i`` (ring stage ``s``, parity ``phase``) in the fragment's layout; arrives
        on ``p_free`` once they are in registers."""
        G: gl.constexpr = BK // 32
        SB: gl.constexpr = 2 if FMT == 1 else 1
        mbarrier.wait(p_ready.index(s), phase)
        b = gl.reshape(_fragment_bytes(p_ring.index(s).slice(HALF_INDEX * R, R), byte_layout, R, BK), [R, G, 16])
        _, off = ws._scale_box(i, col0, False, BK, SB)
        sc = ws._scale_pairs(s_ring.index(s).slice(HALF_INDEX * R, R), off, R, G, gl.SliceLayout(2, b.type.layout),
                             FMT, SW, WORD_SELECT)
        mbarrier.arrive(p_free.index(s), count=1)
        return b, sc

    @gluon.jit
    def _step_fragment(p_ring, s_ring, p_ready, p_free, it, i, col0, HALF_INDEX: gl.constexpr, FMT: gl.constexpr,
                       R: gl.constexpr, BK: gl.constexpr, LOAD_STAGES: gl.constexpr, byte_layout: gl.constexpr,
                       SW: gl.constexpr, acc_layout: gl.constexpr, DGRAD: gl.constexpr, WORD_SELECT: gl.constexpr):
        """The decoded bf16 A fragment ``[R, BK]`` of K step ``i`` (this program's ``it``-th ring use); ``DGRAD``:
        :func:`_dgrad_fragment`."""
        if DGRAD:
            w = _dgrad_fragment(p_ring, s_ring, p_ready, p_free, it, HALF_INDEX, FMT, R, BK, LOAD_STAGES, acc_layout)
        else:
            b, sc = _step_operands(p_ring, s_ring, p_ready, p_free, it % LOAD_STAGES, (it // LOAD_STAGES) & 1, i,
                                   col0, HALF_INDEX, FMT, R, BK, byte_layout, SW, WORD_SELECT)
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
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                          shape=shape)

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
        :func:`.gluon_w4a16.packed_scale_bits`."""
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if FMT == 1:
            return s_tile._reinterpret(gl.int32, [G, BK // 2], flat).load(layout)
        two = s_tile._reinterpret(gl.int16, [G, BK // 2], flat).load(layout).to(gl.int32)
        packed = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4140;", "=r,r", [two], dtype=gl.int32,
                                           is_pure=True, pack=1)
        return ws.packed_scale_bits(packed, FMT)

    @gluon.jit
    def _dgrad_fragment(p_ring, s_ring, p_ready, p_free, it, HALF_INDEX: gl.constexpr, FMT: gl.constexpr,
                        R: gl.constexpr, BK: gl.constexpr, LOAD_STAGES: gl.constexpr, acc_layout: gl.constexpr):
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
        scale2 = gl.expand_dims(_dgrad_scale_pairs(s_ring.index(s).slice(HALF_INDEX * G, G, dim=0),
                                                   gl.SliceLayout(1, words.type.layout), G, BK, FMT), 1)
        mbarrier.arrive(p_free.index(s), count=1)
        low = ws._bf16x2_decode(words & 0x000F000F, scale2, FMT)
        high = ws._bf16x2_decode((words >> 4) & 0x000F000F, scale2, FMT)
        cols = gl.join(gl.reshape(ws.bf16_halves(low), [G, 16, BK]), gl.reshape(ws.bf16_halves(high), [G, 16, BK]))
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        return gl.convert_layout(_dgrad_rows(cols, R, G, True), w_layout, assert_trivial=True)

    @gluon.jit
    def _issue(w, acc, a_ring, a_ready, it, LOAD_STAGES: gl.constexpr):
        """Waits for the ``it``-th activation stage and issues ``acc += w . a_tile^T`` as an async wgmma."""
        s = it % LOAD_STAGES
        mbarrier.wait(a_ready.index(s), (it // LOAD_STAGES) & 1)
        return warpgroup_mma(w, a_ring.index(s).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _rs_consumer(a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, out_ptr, tiles_ptr, n_tiles,
                     n_col_tiles, steps, out_cols, stride_om, HALF_INDEX: gl.constexpr, FMT: gl.constexpr,
                     BM: gl.constexpr, BK: gl.constexpr, LOAD_STAGES: gl.constexpr, R: gl.constexpr,
                     MMA_CHUNKS: gl.constexpr, DECODE_AHEAD: gl.constexpr, DGRAD: gl.constexpr,
                     WORD_SELECT: gl.constexpr):
        """One warpgroup: columns ``[R HALF_INDEX, R HALF_INDEX + R)`` of every ``2 R``-column work item (``R`` = 128
        or 64), ``out^T [R, BM] = W_half . a_tile^T`` with the weight half decoded into the wgmma's register A
        fragment each K step (see the module docstring). Arrives on ``p_free`` once it has read a step's bytes and
        scales and on ``a_free`` once its wgmma retired (both barriers count the two warpgroups). ``DECODE_AHEAD``:
        step ``i + 1``'s fragment is decoded (into its own registers) while step ``i``'s wgmma runs. ``DGRAD``: the
        columns are ``dx``'s (``K``), the K steps run over ``N`` and the fragment is :func:`_dgrad_fragment`'s, its
        rows put back in column order (:func:`_dgrad_rows`) before the store."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        byte_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
        # a row's four scale words in the registers of the threads that hold the row in the fragment
        SW: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]] + ([[64, 0]] if R == 128 else []), lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[R, 4])
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            _, row0, row_end, col0 = ws._tile_at(tiles_ptr, t, n_col_tiles, 2 * R)
            acc = gl.zeros((R, BM), dtype=gl.float32, layout=acc_layout)
            if DECODE_AHEAD:
                # software pipeline, unrolled by two so that no fragment is redefined while a wgmma reading it runs
                # (a loop-carried fragment would be: ptxas then serializes every wgmma, C7513): step i + 1 is decoded
                # into the other fragment while step i's wgmma runs
                w_a = _step_fragment(p_ring, s_ring, p_ready, p_free, it, 0, col0, HALF_INDEX, FMT, R, BK,
                                     LOAD_STAGES, byte_layout, SW, acc_layout, DGRAD, WORD_SELECT)
                for j in range((steps - 1) // 2):  # steps 2 j and 2 j + 1; decodes 2 j + 1 and 2 j + 2
                    acc = _issue(w_a, acc, a_ring, a_ready, it, LOAD_STAGES)
                    w_b = _step_fragment(p_ring, s_ring, p_ready, p_free, it + 1, 2 * j + 1, col0, HALF_INDEX, FMT,
                                         R, BK, LOAD_STAGES, byte_layout, SW, acc_layout, DGRAD, WORD_SELECT)
                    acc, w_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_a))
                    mbarrier.arrive(a_free.index(it % LOAD_STAGES), count=1)
                    acc = _issue(w_b, acc, a_ring, a_ready, it + 1, LOAD_STAGES)
                    w_a = _step_fragment(p_ring, s_ring, p_ready, p_free, it + 2, 2 * j + 2, col0, HALF_INDEX, FMT,
                                         R, BK, LOAD_STAGES, byte_layout, SW, acc_layout, DGRAD, WORD_SELECT)
                    acc, w_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_b))
                    mbarrier.arrive(a_free.index((it + 1) % LOAD_STAGES), count=1)
                    it += 2
                # the last two steps (even steps: the forward's K is a multiple of 256; dgrad's N / 64 may be odd:
                # then only the last step, decoded in the loop)
                if steps % 2 == 0:
                    acc = _issue(w_a, acc, a_ring, a_ready, it, LOAD_STAGES)
                    w_b = _step_fragment(p_ring, s_ring, p_ready, p_free, it + 1, steps - 1, col0, HALF_INDEX, FMT,
                                         R, BK, LOAD_STAGES, byte_layout, SW, acc_layout, DGRAD, WORD_SELECT)
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
                    phase = (it // LOAD_STAGES) & 1
                    if MMA_CHUNKS == 1:  # forward or dgrad
                        w = _step_fragment(p_ring, s_ring, p_ready, p_free, it, i, col0, HALF_INDEX, FMT, R, BK,
                                           LOAD_STAGES, byte_layout, SW, acc_layout, DGRAD, WORD_SELECT)
                        acc = _issue(w, acc, a_ring, a_ready, it, LOAD_STAGES)
                        acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))  # before w's registers are reused
                    else:
                        # the step in K slices (forward only), each decoded while the previous slice's wgmma runs
                        b, sc = _step_operands(p_ring, s_ring, p_ready, p_free, s, phase, i, col0, HALF_INDEX, FMT, R,
                                               BK, byte_layout, SW, WORD_SELECT)
                        a_tile = a_ring.index(s)
                        scw, b = gl.broadcast(gl.expand_dims(sc, 2), b)  # [R, G, 16] scale of each byte's group
                        if MMA_CHUNKS == 2:  # slice j = scale group j
                            b0, b1 = gl.split(gl.permute(b, (0, 2, 1)))
                            s0, s1 = gl.split(gl.permute(scw, (0, 2, 1)))
                            w0 = _decode(b0, s0, FMT, R, BK // 2, acc_layout)
                            mbarrier.wait(a_ready.index(s), phase)
                            acc = warpgroup_mma(w0, a_tile.slice(0, BK // 2, dim=1).permute((1, 0)), acc,
                                                is_async=True)
                            w1 = _decode(b1, s1, FMT, R, BK // 2, acc_layout)
                            acc = warpgroup_mma(w1, a_tile.slice(BK // 2, BK // 2, dim=1).permute((1, 0)), acc,
                                                is_async=True)
                            acc, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0, w1))
                        else:  # 4 slices of 16: slice 2 g + h = half h of scale group g
                            b0, b2, b1, b3 = _quarters(b, R)
                            s0, s2, s1, s3 = _quarters(scw, R)
                            Q: gl.constexpr = BK // 4
                            w0 = _decode(b0, s0, FMT, R, Q, acc_layout)
                            mbarrier.wait(a_ready.index(s), phase)
                            acc = warpgroup_mma(w0, a_tile.slice(0, Q, dim=1).permute((1, 0)), acc, is_async=True)
                            w1 = _decode(b1, s1, FMT, R, Q, acc_layout)
                            acc = warpgroup_mma(w1, a_tile.slice(Q, Q, dim=1).permute((1, 0)), acc, is_async=True)
                            w2 = _decode(b2, s2, FMT, R, Q, acc_layout)
                            acc = warpgroup_mma(w2, a_tile.slice(2 * Q, Q, dim=1).permute((1, 0)), acc,
                                                is_async=True)
                            w3 = _decode(b3, s3, FMT, R, Q, acc_layout)
                            acc = warpgroup_mma(w3, a_tile.slice(3 * Q, Q, dim=1).permute((1, 0)), acc,
                                                is_async=True)
                            acc, w0, w1, w2, w3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0, w1, w2, w3))
                    mbarrier.arrive(a_free.index(s), count=1)
                    it += 1
            if DGRAD:
                acc = _dgrad_rows(acc, R, R // 32, False)
            ws.store_tile(acc, out_ptr, row0, row_end, col0 + HALF_INDEX * R, out_cols, stride_om, R, BM)

    @gluon.jit
    def w4a16_rs_kernel(a_desc, p_desc, s_desc, out_ptr, tiles_ptr, n_tiles, n_col_tiles, N, K, stride_om,
                        FMT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        LOAD_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, MMA_CHUNKS: gl.constexpr,
                        DECODE_AHEAD: gl.constexpr, DGRAD: gl.constexpr):
        """Forward ``y [T, N] = x . dequant(W)^T`` or (``DGRAD``) ``dx [T, K] = dy . dequant(W)`` over the
        ``BN``-column work items (``BN`` = 256 or 128, half per consumer warpgroup) ``t = program_id, program_id +
        programs, ...`` below ``n_tiles`` (as :func:`.gluon_w4a16.w4a16_ws_kernel`); descriptors as there (forward
        blocks of a ``BN``-column tile; dgrad: :func:`.gluon_w4a16.descriptor_blocks` with ``scales_t``)."""
        if DGRAD:  # the last step's rows past N: dy's TMA zero fill times finite weights (zero-filled scales)
            steps = gl.cdiv(N, BK)
            out_cols = K
        else:
            steps = K // BK
            out_cols = N
        # a_free / p_free count both consumer warpgroups
        a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free = ws.load_rings(a_desc, p_desc, s_desc, LOAD_STAGES, 2,
                                                                                 2 if DGRAD else 1)
        R: gl.constexpr = BN // 2
        # the scale word by selects, except with two programs per SM and decode ahead (it spills there)
        WORD_SELECT: gl.constexpr = CONSUMER_REGS >= 200 or not DECODE_AHEAD
        FIRST: gl.constexpr = 0
        SECOND: gl.constexpr = 1
        gl.warp_specialize([
            (ws._loader, (a_desc, p_desc, s_desc, a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, tiles_ptr,
                          n_tiles, n_col_tiles, N, K // 32, steps, DGRAD, BN, BK, LOAD_STAGES, DGRAD)),
            (_rs_consumer, (a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, out_ptr, tiles_ptr, n_tiles,
                            n_col_tiles, steps, out_cols, stride_om, FIRST, FMT, BM, BK, LOAD_STAGES, R,
                            MMA_CHUNKS, DECODE_AHEAD, DGRAD, WORD_SELECT)),
            (_rs_consumer, (a_ring, p_ring, s_ring, a_ready, a_free, p_ready, p_free, out_ptr, tiles_ptr, n_tiles,
                            n_col_tiles, steps, out_cols, stride_om, SECOND, FMT, BM, BK, LOAD_STAGES, R,
                            MMA_CHUNKS, DECODE_AHEAD, DGRAD, WORD_SELECT)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                 out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                 load_stages: int | None = None, persistent: bool | int = False,
                 mma_chunks: int = DEFAULT_MMA_CHUNKS, ctas_per_sm: int = 1,
                 decode_ahead: bool | str = False, fold_scales: bool = False) -> torch.Tensor:
    """``y[T, N]`` bf16, ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` with fp32 accumulation; arguments as
    :func:`.gluon_w4a16.grouped_gemm` (no decode warps: the wgmma warpgroups decode); ``block_n`` 256 or 128
    output columns per tile (default :func:`pick_block_n`), ``block_m`` one of :func:`block_m_choices` (default
    :func:`pick_block_m`), ``load_stages`` default :func:`default_load_stages`; ``mma_chunks`` one of
    :data:`MMA_CHUNK_CHOICES`: wgmmas per K step (see the module docstring); ``ctas_per_sm`` 2: two programs per SM
    (:data:`TWO_PER_SM`: tiles of at most 64 x 128 or 32 x 256; persistent = two per SM), four consumer warpgroups decoding where
    a tile has few rows; ``decode_ahead``: each warpgroup decodes step ``i + 1`` while its step-``i`` wgmma runs (one
    wgmma per K step; its fragments take twice the registers, so tiles of 128 columns); ``"auto"``: wherever the
    tiles have 128 columns and one wgmma per K step (:func:`ahead_where_it_fits`); ``fold_scales``: MXFP4 decoded
    with one multiply where every scale allows it (:func:`fmt_id`)."""
    where = "gluon_w4a16_rs.grouped_gemm"
    block_n, decode_ahead = _resolve_columns(where, m_splits, block_n, decode_ahead, mma_chunks, ctas_per_sm)
    if mma_chunks not in MMA_CHUNK_CHOICES:
        raise ValueError(f"{where}: mma_chunks must be one of {MMA_CHUNK_CHOICES}, got {mma_chunks}")
    if decode_ahead and (mma_chunks != 1 or block_n != 128):
        raise ValueError(f"{where}: decode_ahead runs one wgmma per K step on 128-column tiles (two fragments in "
                         f"registers), got mma_chunks {mma_chunks}, block_n {block_n}")
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"{where}: ctas_per_sm must be 1 or 2, got {ctas_per_sm}")
    block_m = pick_block_m(m_splits, block_n) if block_m is None else block_m
    if ctas_per_sm == 2 and block_m * block_n > TWO_PER_SM["max_tile"]:
        raise ValueError(f"{where}: ctas_per_sm=2 takes tiles of at most 64 rows x 128 columns or 32 x 256 (its "
                         f"consumers have {TWO_PER_SM['consumer_regs']} registers), got block_m {block_m} x "
                         f"block_n {block_n}")
    if persistent is True and ctas_per_sm == 2:
        from kimi_core.kernels.triton_w4a16 import sm_count

        persistent = 2 * sm_count(x.device)
    run = ws.prepare(x, w_packed, w_scale, fmt, m_splits, out, False, where, block_m, block_n, load_stages,
                     persistent, lambda bm: default_load_stages(bm, block_n, ctas_per_sm), block_m_choices(block_n))
    if run.empty:
        return run.out
    kernel_fmt = ws.kernel_fmt_id(run.fmt_id, w_scale, fold_scales)
    w4a16_rs_kernel[run.grid](*run.descs, run.out, run.tiles, run.n_tiles, run.n_col_tiles, run.N, run.K,
                              run.out.stride(0), kernel_fmt, run.block_m, block_n, BK,
                              run.stages, CONSUMER_REGS if ctas_per_sm == 1 else TWO_PER_SM["consumer_regs"], mma_chunks,
                              decode_ahead, False,
                              num_warps=4, **({} if ctas_per_sm == 1 else {"maxnreg": TWO_PER_SM["maxnreg"]}))
    return run.out


def grouped_gemm_dgrad(dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                       out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                       load_stages: int | None = None, persistent: bool | int = False,
                       decode_ahead: bool | str = False, fold_scales: bool = False) -> torch.Tensor:
    """``dx[T, K]`` bf16, ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` with fp32 accumulation (``dy`` bf16 ``[T,
    N]``; ``N`` a multiple of 64), the weights decoded into the wgmma's register A fragment as ``W^T`` (``K``
    output columns x ``N``): the two nibbles of a packed byte are neighbouring output columns, which one m64
    fragment spreads over rows ``r`` and ``r + 8`` of one thread, so the fragment's rows are the output columns
    reordered (:func:`_dgrad_rows`; put back before the store) and each thread decodes whole bytes. The scales go as
    a transposed copy ``[E * K / 32, N]`` made per call by a tiled Triton transpose (extra memory: 1/16 of the packed
    bytes, e.g. 77 MB for K3 fc1 MXFP4) so a step's scales are one ``[block_n / 32, 64]`` TMA box. Tiles,
    persistence, ``decode_ahead`` and ``fold_scales`` as :func:`grouped_gemm` (its one-wgmma-per-step form)."""
    where = "gluon_w4a16_rs.grouped_gemm_dgrad"
    block_n, decode_ahead = _resolve_columns(where, m_splits, block_n, decode_ahead)
    if decode_ahead and block_n != 128:
        raise ValueError(f"{where}: decode_ahead runs on 128-column tiles (two fragments in registers), got block_n "
                         f"{block_n}")
    block_m = pick_block_m(m_splits, block_n) if block_m is None else block_m
    run = ws.prepare(dy, w_packed, w_scale, fmt, m_splits, out, True, where, block_m, block_n, load_stages,
                     persistent, lambda bm: default_load_stages(bm, block_n, dgrad=True), block_m_choices(block_n),
                     scales_t=True)
    if run.empty:
        return run.out
    kernel_fmt = ws.kernel_fmt_id(run.fmt_id, w_scale, fold_scales)
    w4a16_rs_kernel[run.grid](*run.descs, run.out, run.tiles, run.n_tiles, run.n_col_tiles, run.N, run.K,
                              run.out.stride(0), kernel_fmt, run.block_m, block_n, BK,
                              run.stages, CONSUMER_REGS, 1,
                              decode_ahead, True, num_warps=4)
    return run.out
