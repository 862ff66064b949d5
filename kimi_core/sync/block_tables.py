"""The block tables that drive the GPU copy + block-sums kernel over the buckets of an adapter version.

The kernel :func:`kimi_core.kernels.block_sums.copy_sum_blocks` runs one program per block of
:func:`kimi_core.sync.checksum.block_layout` from a table ``int64 [6, n_blocks]``: source word, words to
read from the source, destination word, block length, sums word, expected-sums word; each word address
is a base (a launch argument, 0 for absolute addresses) plus 8 times the row. Three builders:

* :func:`bucket_table`: one bucket copied word for word (relative rows);
* :func:`flatten_table`: the tensors of every bucket of an adapter version gathered into their
  buckets in one launch (absolute rows throughout), the trainer's flatten;
* :func:`version_table`: every bucket of an adapter version copied into persistent receive buffers
  (absolute rows throughout), the colocated engine's one launch per version.

All are cached: an adapter's parameters, the trainer's bucket buffers and the engine's receive
buffers keep their addresses from step to step.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kimi_core.sync.checksum import ALIGN, block_layout

__all__ = ["bucket_table", "flatten_table", "gather_addresses", "version_table"]


def _table(rows: list[np.ndarray], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(r, dtype=np.int64) for r in rows])).to(device)


def _copy_rows(starts: tuple[int, ...], total: int) -> list[np.ndarray]:
    """Rows copying a bucket word for word, relative to every base."""
    lay = block_layout(starts, total)
    n, idx = lay.bend - lay.bst, np.arange(len(lay.bst), dtype=np.int64)
    return [lay.bst, n, lay.bst, n, idx, idx]


def _gather_rows(
    addrs: tuple[int, ...], nbytes: tuple[int, ...], starts: tuple[int, ...], total: int
) -> list[np.ndarray]:
    """Rows flattening tensors at byte addresses ``addrs`` (multiples of :data:`ALIGN`) of ``nbytes``
    each (multiples of 8) into a bucket with regions ``starts``: the source row absolute, a region's
    alignment gap read as zeros."""
    lay = block_layout(starts, total)
    into = lay.bst - lay.w_starts[lay.region]  # words into the block's region
    length = lay.bend - lay.bst
    src_word = np.asarray(addrs, dtype=np.int64)[lay.region] // 8 + into
    n_src = np.clip(np.asarray(nbytes, dtype=np.int64)[lay.region] // 8 - into, 0, length)
    idx = np.arange(len(lay.bst), dtype=np.int64)
    return [src_word, n_src, lay.bst, length, idx, idx]


def _concat(parts: list[tuple[list[np.ndarray], tuple[int, int, int, int]]], device) -> tuple[torch.Tensor, tuple]:
    """One table from per-bucket rows, each shifted by its ``(src, dst, sums, expect)`` word offsets;
    returns it and each part's first block (the total last)."""
    rows: list[list[np.ndarray]] = [[] for _ in range(6)]
    first = [0]
    for part, (src, dst, sums, expect) in parts:
        for row, r, shift in zip(rows, part, (src, 0, dst, 0, sums, expect)):
            row.append(r + shift)
        first.append(first[-1] + len(part[0]))
    return _table([np.concatenate(r) if r else np.zeros(0, np.int64) for r in rows], device), tuple(first)


@functools.lru_cache(maxsize=64)
def bucket_table(starts: tuple[int, ...], total: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Copy (and sum) one bucket word for word: rows relative to the source, destination, sums and
    expected-sums bases. Also returns whether every block starts 64-byte aligned (every region does,
    as in a bucket)."""
    return _table(_copy_rows(starts, total), device), all(s % ALIGN == 0 for s in starts)


def gather_addresses(tensors, device: torch.device) -> tuple[int, ...] | None:
    """Source addresses for :func:`flatten_table`, or ``None`` unless every tensor is contiguous on
    ``device`` at an :data:`ALIGN`-byte aligned address (as every allocation) with a whole number of
    8-byte words."""
    addrs = []
    for t in tensors:
        a = t.data_ptr()
        if t.device != device or a % ALIGN or (t.numel() * t.element_size()) % 8 or not t.is_contiguous():
            return None
        addrs.append(a)
    return tuple(addrs)


@functools.lru_cache(maxsize=4)  # device tables of whole versions: tens of MB each
def flatten_table(
    buckets: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int, int], ...], device: torch.device
) -> torch.Tensor:
    """Flatten every bucket of a version in one launch (the trainer). ``buckets``: per bucket
    ``(tensor addresses, tensor nbytes, region starts, nbytes, bucket address, address of its block
    sums)``, all addresses multiples of :data:`ALIGN`. Every row is absolute (bases 0)."""
    return _concat(
        [(_gather_rows(a, nb, st, total), (0, dst // 8, sums // 8, 0)) for a, nb, st, total, dst, sums in buckets],
        device,
    )[0]


@functools.lru_cache(maxsize=4)  # device tables of whole versions: tens of MB each
def version_table(
    buckets: tuple[tuple[int, int, int, tuple[int, ...], int], ...], device: torch.device
) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """Copy every bucket of a version in one launch (the colocated engine). ``buckets``: per bucket
    ``(source address, destination address, address of the sender's block sums, region starts,
    nbytes)``. Source, destination and expected-sums rows are absolute (bases 0); the sums row
    indexes one ``int64 [n_blocks]`` buffer for the whole version. Returns the table, each bucket's
    first block (and the total as the last entry), and whether every block is 64-byte aligned."""
    parts, offset = [], 0
    for src, dst, expect, starts, nbytes in buckets:
        rows = _copy_rows(starts, nbytes)
        parts.append((rows, (src // 8, dst // 8, offset, expect // 8)))
        offset += len(rows[0])
    table, first = _concat(parts, device)
    aligned = all(
        src % ALIGN == 0 and dst % ALIGN == 0 and all(x % ALIGN == 0 for x in st) for src, dst, _, st, _ in buckets
    )
    return table, first, aligned
