"""``kimi_core.kernels.host_ints`` on the CPU: offsets, values, shapes and dtype of the tables the kernels get
(the GPU side, no host wait, is tests/kimi_core/kernels/w4a16/test_no_host_sync_gpu.py)."""

from __future__ import annotations

import torch

from kimi_core.kernels.host_ints import host_offsets, int32_on
from kimi_core.kernels.w4a16.gluon.tiles import tile_table


def test_offsets_and_tables_keep_their_values():
    off = int32_on(host_offsets(torch.tensor([3, 0, 5, 1])), "cpu")
    assert off.dtype == torch.int32 and off.tolist() == [0, 3, 3, 8, 9]
    table = int32_on([(0, 0, 3), (2, 3, 8)], torch.device("cpu"))
    assert table.shape == (2, 3) and table.dtype == torch.int32 and table[1].tolist() == [2, 3, 8]


def test_tile_table_rows_by_hand():
    """Expert 0: 5 rows in tiles of 4 -> rows 0-3, 4; expert 1 empty: no tile; expert 2: rows 5-6."""
    assert tile_table([5, 0, 2], 4, "cpu").tolist() == [[0, 0, 5], [0, 4, 5], [2, 5, 7]]
    empty = tile_table([0, 0], 4, "cpu")
    assert empty.shape == (0, 3) and empty.dtype == torch.int32
