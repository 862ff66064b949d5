"""Tile scheduling shared by the fused Triton W4A16 kernels (:mod:`.forward`, :mod:`.dgrad`).

Rows are sorted by expert; ``offsets`` int32 ``[E + 1]`` holds each expert's first row. Each program finds its
(expert, row tile, column tile) from ``offsets`` with one vector load and a prefix sum, so neither the launcher nor
the kernel needs the host to know the split.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_row_tiles(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """``(ev, lo, hi, ntiles)``: expert indices ``[E_POW2]`` (past ``E``: empty), each expert's first and end row,
    and its row tiles of ``BLOCK_M``."""
    ev = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + ev, mask=ev < E, other=0)
    hi = tl.load(offsets_ptr + ev + 1, mask=ev < E, other=0)
    return ev, lo, hi, (hi - lo + BLOCK_M - 1) // BLOCK_M


@triton.jit
def schedule_tile(pid, offsets_ptr, E, num_cols, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a program id to ``(valid, expert, col_block, rows, row_mask)``.

    Row tiles of all experts are numbered back to back; ``GROUP_M`` consecutive row tiles share a
    sweep over the column blocks so that their weight tiles and activation tiles meet in L2.
    """
    ev, lo, hi, ntiles = expert_row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)
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
def mma(a, b, acc, INTERP: tl.constexpr):
    """``acc + a . b``; the interpreter multiplies bf16 arrays wrongly, so it gets fp32 operands."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def total_tiles(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Row tiles of all experts together (the count :func:`schedule_tile` numbers)."""
    return tl.sum(expert_row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)[3], 0)


@triton.jit
def output_tile_bases(x_ptr, wq_ptr, ws_ptr, e, pid_n, rows, N, stride_xt, stride_we, stride_se, BLOCK_N: tl.constexpr):
    """Columns ``offs_n`` (and their mask) of output tile ``pid_n``, expert ``e``'s weight and scale bases and the
    activation rows' pointers ``[BM, 1]``."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    e64 = e.to(tl.int64)
    wq_e = wq_ptr + e64 * stride_we
    ws_e = ws_ptr + e64 * stride_se
    return offs_n, n_mask, wq_e, ws_e, x_ptr + rows.to(tl.int64)[:, None] * stride_xt
