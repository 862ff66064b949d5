"""The fused Triton W4A16 forward: ``y[T, N] = x[T, K] . dequant(W_e)[N, K]^T`` for the rows of each expert.

The packed weight tile is loaded, decoded to bf16 in registers (:mod:`.decode`) and fed to the tensor cores; no bf16
copy of a weight reaches HBM. Accumulation is fp32. Both kernels compute the transposed product (``acc[BLOCK_N,
BLOCK_M] = W_tile . x_tile^T``), so the decoded weight tile is the MMA's left operand and the token count only sets
the MMA's narrow side: 8 tokens per expert waste no more than a 16-wide tile.

* :func:`w4a16_fwd_perm_kernel` (``K % 128 == 0``): whole int32 words decoded at once, the reduction axis permuted
  so each thread's MMA operand registers are exactly a word's decoded pairs; options ``ROW_LOADS``, ``K_PAIRS``,
  ``TAIL_SPLIT`` and ``PERSISTENT`` (:mod:`.plans` picks them).
* :func:`w4a16_fwd_kernel`: any ``K`` (a multiple of 32), tiles decoded element by element.

Launch: :func:`.launch.grouped_gemm`. Naive twin: :func:`kimi_core.kernels.w4a16.naive.w4a16_grouped_gemm`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_core.kernels.w4a16.fused import plans
from kimi_core.kernels.w4a16.fused.decode import decode_words, load_weight_tile, scale_bf16
from kimi_core.kernels.w4a16.fused.tiles import mma, output_tile_bases, schedule_tile, total_tiles

# the permuted forward's reduction step (one decoded [BN, 128] weight tile) and, with K_PAIRS, a loop iteration's two
FWD_STEP = tl.constexpr(plans.FWD_STEP)
FWD_PAIR_STEP = tl.constexpr(plans.FWD_PAIR_STEP)


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
    sb = scale_bf16(sb, FMT)
    s3 = tl.broadcast_to(sb[:, :, None], (BLOCK_N, 4, 4))
    o0, o1, o2, o3, o4, o5, o6, o7 = decode_words(q, s3, FMT, USE_ASM)  # each [BN, 4(t), 4(w)]
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
def _fwd_perm_tile(
    wq_ptr,
    ws_ptr,
    x_rows,
    row_mask,
    offs_n,
    n_mask,
    k0,
    stride_wn,
    stride_sn,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
    ROW_LOADS: tl.constexpr,
):
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
        q = tl.load(
            wq_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + tl.arange(0, 16))[None, :], mask=n_mask[:, None], other=0
        ).reshape(BLOCK_N, 4, 4)  # int32 [BN, 4(t), 4(w)]
    else:
        word = k0 // 8 + wt[:, None] * 4 + tl.arange(0, 4)[None, :]  # [4(t), 4(w)] word index in the row
        q = tl.load(
            wq_ptr + offs_n[:, None, None] * stride_wn + word[None, :, :], mask=n_mask[:, None, None], other=0
        )  # int32 [BN, 4, 4]
    sb = _fwd_perm_scales(ws_ptr, offs_n, n_mask, k0, stride_sn, FMT, 4)
    return _fwd_perm_decode(q, sb, FMT, USE_ASM), _fwd_perm_x(x_rows, row_mask, k0)


@triton.jit
def _fwd_perm_pair(
    wq_ptr,
    ws_ptr,
    x_rows,
    row_mask,
    offs_n,
    n_mask,
    k0,
    stride_wn,
    stride_sn,
    acc,
    FMT: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``acc [BN, BM]`` plus the products of the two 128-wide K steps from ``k0``, first step first (the same sums
    as two :func:`_fwd_perm_tile` steps). A row's 32 words of both steps are loaded as one 128-byte run ``[BN, 32]``
    and its 8 scales as one ``[BN, 8]``, then split per step."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    q = tl.load(
        wq_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + tl.arange(0, 32))[None, :], mask=n_mask[:, None], other=0
    )  # int32 [BN, 32]: both steps' words of a row
    q0, q1 = tl.split(tl.permute(q.reshape(BLOCK_N, 2, 16), (0, 2, 1)))  # each [BN, 16]
    s = _fwd_perm_scales(ws_ptr, offs_n, n_mask, k0, stride_sn, FMT, 8)
    s0, s1 = tl.split(tl.permute(s.reshape(BLOCK_N, 2, 4), (0, 2, 1)))  # each [BN, 4]
    w = _fwd_perm_decode(q0.reshape(BLOCK_N, 4, 4), s0, FMT, USE_ASM)
    acc = mma(w, tl.trans(_fwd_perm_x(x_rows, row_mask, k0)), acc, INTERP)
    w = _fwd_perm_decode(q1.reshape(BLOCK_N, 4, 4), s1, FMT, USE_ASM)
    return mma(w, tl.trans(_fwd_perm_x(x_rows, row_mask, k0 + 128)), acc, INTERP)


@triton.jit
def _fwd_perm_steps(
    wq_e,
    ws_e,
    x_rows,
    row_mask,
    offs_n,
    n_mask,
    k_lo,
    k_hi,
    stride_wn,
    stride_sn,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr,
    ROW_LOADS: tl.constexpr,
    K_PAIRS: tl.constexpr = False,
):
    """fp32 ``acc [BN, BM]`` = the permuted forward's products over the 128-wide K steps from ``k_lo`` to ``k_hi``,
    added in step order. ``K_PAIRS``: two steps per loop iteration (:func:`_fwd_perm_pair`; ``k_lo`` and ``k_hi``
    multiples of 256), the same sums."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if K_PAIRS:
        for k0 in range(k_lo, k_hi, FWD_PAIR_STEP):
            acc = _fwd_perm_pair(
                wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn, acc, FMT, USE_ASM, INTERP
            )
    else:
        for k0 in range(k_lo, k_hi, FWD_STEP):
            w, x = _fwd_perm_tile(
                wq_e, ws_e, x_rows, row_mask, offs_n, n_mask, k0, stride_wn, stride_sn, FMT, BLOCK_N, USE_ASM, ROW_LOADS
            )
            acc = mma(w, tl.trans(x), acc, INTERP)  # [BN, BM]
    return acc


@triton.jit
def _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt):
    """``y[rows, offs_n] = bf16(acc^T)`` for fp32 ``acc [BN, BM]``, masked to the tile's rows and columns."""
    y = tl.trans(acc).to(tl.bfloat16)  # [BM, BN]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, y, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _fwd_perm_output(
    x_ptr,
    wq_ptr,
    ws_ptr,
    y_ptr,
    e,
    pid_n,
    rows,
    row_mask,
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr,
    ROW_LOADS: tl.constexpr,
    K_PAIRS: tl.constexpr = False,
):
    """One output tile of the permuted forward: ``y[rows, pid_n * BLOCK_N :][:BLOCK_N]`` of expert ``e``."""
    offs_n, n_mask, wq_e, ws_e, x_rows = output_tile_bases(
        x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt, stride_we, stride_se, BLOCK_N
    )
    acc = _fwd_perm_steps(
        wq_e,
        ws_e,
        x_rows,
        row_mask,
        offs_n,
        n_mask,
        0,
        K,
        stride_wn,
        stride_sn,
        FMT,
        BLOCK_M,
        BLOCK_N,
        USE_ASM,
        INTERP,
        ROW_LOADS,
        K_PAIRS,
    )
    _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt)


@triton.jit
def _fwd_perm_tail_piece(
    x_ptr,
    wq_ptr,
    ws_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    piece,
    e,
    pid_n,
    rows,
    row_mask,
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr,
    ROW_LOADS: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    K_PAIRS: tl.constexpr = False,
):
    """Piece ``piece % TAIL_SPLIT`` of tail tile ``piece // TAIL_SPLIT``: that range of the reduction's 128-wide steps
    (whole steps, or whole pairs of steps with ``K_PAIRS``; the last range shorter), its fp32 partial sum ``[BN, BM]``
    written to ``part_ptr`` slot ``piece``; the tile's last piece to finish (a counter per tile in ``count_ptr``,
    zeroed by the launcher) adds the tile's ``TAIL_SPLIT`` partial sums in piece order and stores the bf16 tile, so
    the result does not depend on which piece finished last."""
    offs_n, n_mask, wq_e, ws_e, x_rows = output_tile_bases(
        x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt, stride_we, stride_se, BLOCK_N
    )
    j = piece // TAIL_SPLIT
    STEP: tl.constexpr = FWD_PAIR_STEP if K_PAIRS else FWD_STEP
    k_len = tl.cdiv(K // STEP, TAIL_SPLIT) * STEP
    k_lo = (piece % TAIL_SPLIT) * k_len
    k_hi = tl.minimum(K, k_lo + k_len)
    acc = _fwd_perm_steps(
        wq_e,
        ws_e,
        x_rows,
        row_mask,
        offs_n,
        n_mask,
        k_lo,
        k_hi,
        stride_wn,
        stride_sn,
        FMT,
        BLOCK_M,
        BLOCK_N,
        USE_ASM,
        INTERP,
        ROW_LOADS,
        K_PAIRS,
    )
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
def w4a16_fwd_perm_kernel(
    x_ptr,
    wq_ptr,
    ws_ptr,
    y_ptr,
    offsets_ptr,
    N,
    K,
    E,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
    ROW_LOADS: tl.constexpr = False,
    TAIL_SPLIT: tl.constexpr = 1,
    full_tiles=0,
    part_ptr=None,
    count_ptr=None,
    K_PAIRS: tl.constexpr = False,
):
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
        total = total_tiles(offsets_ptr, E, BLOCK_M, E_POW2) * num_n
        for t in tl.range(pid, total, tl.num_programs(0), flatten=True):
            _, e, pid_n, rows, row_mask = schedule_tile(t, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
            _fwd_perm_output(
                x_ptr,
                wq_ptr,
                ws_ptr,
                y_ptr,
                e,
                pid_n,
                rows,
                row_mask,
                N,
                K,
                stride_xt,
                stride_we,
                stride_wn,
                stride_se,
                stride_sn,
                stride_yt,
                FMT,
                BLOCK_M,
                BLOCK_N,
                USE_ASM,
                INTERP,
                ROW_LOADS,
                K_PAIRS,
            )
    elif TAIL_SPLIT > 1:
        piece = pid - full_tiles  # >= 0: a piece of tail tile full_tiles + piece // TAIL_SPLIT
        tile = tl.where(piece < 0, pid, full_tiles + piece // TAIL_SPLIT)
        valid, e, pid_n, rows, row_mask = schedule_tile(tile, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
        if valid:
            if piece < 0:
                _fwd_perm_output(
                    x_ptr,
                    wq_ptr,
                    ws_ptr,
                    y_ptr,
                    e,
                    pid_n,
                    rows,
                    row_mask,
                    N,
                    K,
                    stride_xt,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    stride_yt,
                    FMT,
                    BLOCK_M,
                    BLOCK_N,
                    USE_ASM,
                    INTERP,
                    ROW_LOADS,
                    K_PAIRS,
                )
            else:
                _fwd_perm_tail_piece(
                    x_ptr,
                    wq_ptr,
                    ws_ptr,
                    y_ptr,
                    part_ptr,
                    count_ptr,
                    piece,
                    e,
                    pid_n,
                    rows,
                    row_mask,
                    N,
                    K,
                    stride_xt,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    stride_yt,
                    FMT,
                    BLOCK_M,
                    BLOCK_N,
                    USE_ASM,
                    INTERP,
                    ROW_LOADS,
                    TAIL_SPLIT,
                    K_PAIRS,
                )
    else:
        valid, e, pid_n, rows, row_mask = schedule_tile(pid, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
        if valid:
            _fwd_perm_output(
                x_ptr,
                wq_ptr,
                ws_ptr,
                y_ptr,
                e,
                pid_n,
                rows,
                row_mask,
                N,
                K,
                stride_xt,
                stride_we,
                stride_wn,
                stride_se,
                stride_sn,
                stride_yt,
                FMT,
                BLOCK_M,
                BLOCK_N,
                USE_ASM,
                INTERP,
                ROW_LOADS,
                K_PAIRS,
            )


@triton.jit
def w4a16_fwd_kernel(
    x_ptr,
    wq_ptr,
    ws_ptr,
    y_ptr,
    offsets_ptr,
    N,
    K,
    E,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERP: tl.constexpr = False,
):
    """``y[rows_e] = x[rows_e] . dequant(W_e)^T``; one program per (row tile, BLOCK_N columns)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    valid, e, pid_n, rows, row_mask = schedule_tile(pid, offsets_ptr, E, num_n, BLOCK_M, E_POW2, GROUP_M)
    if valid:
        offs_n, n_mask, wq_e, ws_e, x_rows = output_tile_bases(
            x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt, stride_we, stride_se, BLOCK_N
        )
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None], other=0.0)
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            w = load_weight_tile(
                wq_e, ws_e, offs_n, n_mask, k0, K, stride_wn, stride_sn, FMT, BLOCK_N, BLOCK_K, EVEN_K
            )  # [BN, BK] bf16
            acc = mma(w, tl.trans(x), acc, INTERP)  # [BN, BM]
        _store_fwd_tile(y_ptr, acc, rows, row_mask, offs_n, n_mask, stride_yt)
