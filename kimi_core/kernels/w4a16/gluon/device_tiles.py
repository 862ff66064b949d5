"""The Gluon kernels' tile table built on the GPU from device-side ``m_splits`` (no host sync, capturable in a CUDA
graph): one small Triton kernel writes the rows of :func:`.tiles.tile_rows` into a table sized for the most tiles any
split of ``T`` rows over ``E`` experts can have, and the real count beside it, which the register kernel reads
(``COUNT_ON_DEVICE``) instead of a host count. Runs in Triton's interpreter on CPU tensors (tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SLOTS_PER_PROGRAM", "device_tile_table", "most_tiles", "tile_table_kernel"]

SLOTS_PER_PROGRAM = 64  # table rows each program of the builder writes


def most_tiles(total_rows: int, num_experts: int, block_m: int) -> int:
    """The most row tiles of ``block_m`` any split of ``total_rows`` rows over ``num_experts`` experts has: each
    non-empty expert adds at most one partial tile to ``total_rows // block_m`` whole ones, and at most
    ``min(E, T)`` experts are non-empty."""
    return total_rows // block_m + min(num_experts, total_rows)


@triton.jit
def tile_table_kernel(
    splits_ptr, table_ptr, count_ptr, E, slots, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr
):
    """Rows ``[program * BLOCK, program * BLOCK + BLOCK)`` of the table ``[slots, 3]`` int32 (expert, first row, end
    row) of ``E`` experts with ``splits_ptr[e]`` rows each, in order, ``BLOCK_M`` rows per tile; rows past the real
    count are (0, 0, 0). Program 0 writes the count to ``count_ptr``."""
    ev = tl.arange(0, E_POW2)
    m = tl.load(splits_ptr + ev, mask=ev < E, other=0).to(tl.int32)
    hi = tl.cumsum(m, 0)  # each expert's end row
    lo = hi - m
    nt = (m + BLOCK_M - 1) // BLOCK_M  # its tiles
    cum = tl.cumsum(nt, 0)
    total = tl.sum(nt, 0)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] table rows
    e = tl.sum((cum[None, :] <= r[:, None]).to(tl.int32), 1)  # the expert whose tiles hold row r
    sel = ev[None, :] == e[:, None]  # [BLOCK, E_POW2]
    first = tl.sum(tl.where(sel, (cum - nt)[None, :], 0), 1)
    row_lo = tl.sum(tl.where(sel, lo[None, :], 0), 1)
    row_hi = tl.sum(tl.where(sel, hi[None, :], 0), 1)
    valid = r < total
    keep = r < slots
    tl.store(table_ptr + r * 3, tl.where(valid, e, 0), mask=keep)
    tl.store(table_ptr + r * 3 + 1, tl.where(valid, row_lo + (r - first) * BLOCK_M, 0), mask=keep)
    tl.store(table_ptr + r * 3 + 2, tl.where(valid, row_hi, 0), mask=keep)
    if tl.program_id(0) == 0:
        tl.store(count_ptr, total)


def device_tile_table(
    m_splits: torch.Tensor, block_m: int, total_rows: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table [most_tiles, 3] int32, count [1] int32)`` on ``device`` for the integer tensor ``m_splits`` ``[E]``
    (summing to ``total_rows``, never read on the host): :func:`tile_table_kernel` on the current stream."""
    E = m_splits.numel()
    slots = most_tiles(total_rows, E, block_m)
    table = torch.empty((slots, 3), dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    splits = m_splits.to(device=device)
    grid = (max(1, -(-slots // SLOTS_PER_PROGRAM)),)
    tile_table_kernel[grid](
        splits,
        table,
        count,
        E,
        slots,
        BLOCK_M=block_m,
        E_POW2=max(16, 1 << max(0, E - 1).bit_length()),
        BLOCK=SLOTS_PER_PROGRAM,
        num_warps=4,
    )
    return table, count
