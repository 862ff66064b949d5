"""The fused Triton W4A16 dgrad: ``dx[T, K] = dy[T, N] . dequant(W_e)[N, K]`` for the rows of each expert.

* :func:`w4a16_dgrad_perm_kernel` (``K % 256 == 0``): whole int32 words decoded at once into a permuted ``W^T``
  tile, optionally split over ``N`` (``SPLIT_N``, fp32 partial sums summed by :func:`sum_partials_kernel`).
* :func:`w4a16_dgrad_kernel`: any ``K`` (a multiple of 32), tiles decoded element by element.

Launch: :func:`.launch.grouped_gemm_dgrad`. Naive twin: :func:`kimi_core.kernels.w4a16.naive.w4a16_grouped_gemm_dgrad`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_core.kernels.w4a16.fused.decode import decode_words, load_weight_tile, scale_bf16
from kimi_core.kernels.w4a16.fused.tiles import mma, schedule_tile


@triton.jit
def w4a16_dgrad_kernel(
    dy_ptr,
    wq_ptr,
    ws_ptr,
    dx_ptr,
    offsets_ptr,
    N,
    K,
    E,
    stride_dyt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_dxt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_N: tl.constexpr,
    INTERP: tl.constexpr = False,
):
    """``dx[rows_e] = dy[rows_e] . dequant(W_e)``; one program per (row tile, BLOCK_K input columns).

    The reduction runs over ``N`` in steps of ``BLOCK_N``; ``K`` must be a multiple of ``BLOCK_K``
    (the launcher checks), so the weight tile's columns never need a mask.
    """
    pid = tl.program_id(0)
    num_k = K // BLOCK_K
    valid, e, pid_k, rows, row_mask = schedule_tile(pid, offsets_ptr, E, num_k, BLOCK_M, E_POW2, GROUP_M)
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
            w = load_weight_tile(
                wq_e, ws_e, offs_n, n_mask, k0, K, stride_wn, stride_sn, FMT, BLOCK_N, BLOCK_K, True
            )  # [BN, BK]
            acc = mma(tl.trans(w), tl.trans(dy), acc, INTERP)  # [BK, BM]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        dx = tl.trans(acc).to(tl.bfloat16)  # [BM, BK]
        dx_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * stride_dxt + offs_k[None, :]
        tl.store(dx_ptrs, dx, mask=row_mask[:, None])


@triton.jit
def w4a16_dgrad_perm_kernel(
    dy_ptr,
    wq_ptr,
    ws_ptr,
    dx_ptr,
    offsets_ptr,
    N,
    K,
    E,
    stride_dyt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_dxt,
    FMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    USE_ASM: tl.constexpr,
    EVEN_N: tl.constexpr,
    INTERP: tl.constexpr = False,
    SPLIT_N: tl.constexpr = 1,
    stride_part=0,
    ROW_LOADS: tl.constexpr = False,
):
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
    valid, e, pid_k, rows, row_mask = schedule_tile(pid, offsets_ptr, E, num_k, BLOCK_M, E_POW2, GROUP_M)
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
                w_ptrs = (
                    wq_e
                    + offs_n[:, None, None] * stride_wn
                    + (k0 // 8 + 16 * tl.arange(0, 2)[:, None] + tl.arange(0, 16)[None, :])[None]
                )
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
            sb = scale_bf16(sb.reshape(BLOCK_N, 4, 2), FMT)
            s4 = tl.broadcast_to(sb[:, :, :, None], (BLOCK_N, 4, 2, 4))
            o0, o1, o2, o3, o4, o5, o6, o7 = decode_words(q, s4, FMT, USE_ASM)
            p = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
            # p: [BN, a, b, c, h, r0, r1] -> [r1, r0, a, h, b, c, BN]
            wt = tl.permute(p, (6, 5, 1, 4, 2, 3, 0)).reshape(256, BLOCK_N)
            acc = mma(wt, tl.trans(dy), acc, INTERP)  # [256, BM]
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
