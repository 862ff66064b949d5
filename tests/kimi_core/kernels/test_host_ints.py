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


def test_split_patterns_are_read_once_and_their_tables_kept():
    """A list, a tuple and a CPU tensor of the same splits give one :class:`SplitPattern` (offsets and total by hand);
    its device tables are built on first use and the same object after; another pattern gets its own; a CUDA tensor
    is never read (None)."""
    from kimi_core.kernels.host_ints import SplitPattern, split_pattern

    p = split_pattern([3, 0, 5, 1])
    assert isinstance(p, SplitPattern) and p == (3, 0, 5, 1) and p.offsets == (0, 3, 3, 8, 9) and p.total == 9
    assert split_pattern((3, 0, 5, 1)) is p and split_pattern(torch.tensor([3, 0, 5, 1])) is p
    assert split_pattern(p) is p
    off = p.device_offsets("cpu")
    assert off.dtype == torch.int32 and off.tolist() == [0, 3, 3, 8, 9] and p.device_offsets("cpu") is off
    assert tile_table(p, 4, "cpu") is tile_table([3, 0, 5, 1], 4, "cpu")
    assert p.row_tiles(4) == 1 + 0 + 2 + 1 and p.busy_mean() == 3.0
    q = split_pattern([3, 1, 5, 0])
    assert q is not p and q.device_offsets("cpu").tolist() == [0, 3, 4, 9, 9]
    assert split_pattern([0, 0]).busy_mean() == 0.0


def test_tile_rows_match_a_loop_over_the_tiles():
    """The vectorized tile table equals the loop that walks each expert's rows in ``block_m`` steps."""
    from kimi_core.kernels.w4a16.gluon.tiles import tile_rows

    g = torch.Generator().manual_seed(0)
    for block in (8, 64, 256):
        splits = torch.randint(0, 700, (37,), generator=g)
        splits[::5] = 0
        want, start = [], 0
        for e, m in enumerate(splits.tolist()):
            want += [[e, r, start + m] for r in range(start, start + m, block)]
            start += m
        from kimi_core.kernels.host_ints import split_pattern

        assert tile_rows(split_pattern(splits), block).tolist() == want
