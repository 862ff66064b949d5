"""Checksum blocks of flat buckets, and the block tables that drive the GPU copy + sums kernel.

A bucket's tensor regions (``starts``, each a multiple of 8 bytes) are cut into blocks of
:data:`BLOCK_WORDS` 64-bit words from each region's start (:func:`block_layout`). The kernel
:func:`kimi_core.kernels.block_sums.copy_sum_blocks` runs one program per block from a table
``int64 [6, n_blocks]``: source word, words to read from the source, destination word, block length,
sums word, expected-sums word; each word address is a base (a launch argument, 0 for absolute
addresses) plus 8 times the row. Three builders:

* :func:`bucket_table`: one bucket copied word for word (relative rows);
* :func:`gather_table`: many tensors gathered into one bucket (absolute source rows), the trainer's
  flatten;
* :func:`version_table`: every bucket of an adapter version copied into persistent receive buffers
  (absolute rows throughout), the colocated engine's one launch per version.

All are cached: an adapter's parameters, the trainer's bucket buffers and the engine's receive
buffers keep their addresses from step to step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["ALIGN", "BLOCK_WORDS", "Layout", "block_layout", "bucket_table", "gather_addresses", "gather_table",
           "version_table"]

ALIGN = 64  # every tensor region starts at a multiple of ALIGN bytes
BLOCK_WORDS = 4096


class Layout(NamedTuple):
    """Word-level block partition of a bucket's regions (see :func:`block_layout`)."""

    w_starts: np.ndarray  # int64 [R+1]: region word boundaries
    nonempty: np.ndarray  # indices of regions with at least one word
    bst: np.ndarray  # int64 [n_blocks]: each block's first word
    bend: np.ndarray  # int64 [n_blocks]: one past its last word
    first_block: np.ndarray  # each nonempty region's first block
    local: np.ndarray  # uint64 [n_blocks]: the block's position inside its region
    region: np.ndarray  # int64 [n_blocks]: the block's region


def block_layout(starts, total: int) -> Layout:
    """Block partition of the byte regions ``[starts[i], starts[i+1])`` (the last ends at ``total``); cached."""
    return _layout(tuple(int(x) for x in starts), int(total))


@functools.lru_cache(maxsize=64)
def _layout(starts: tuple[int, ...], total: int) -> Layout:
    if total % 8 or any(s % 8 for s in starts):
        raise ValueError("region_sums: regions must be 8-byte aligned")
    w_starts = np.append(np.asarray(starts, dtype=np.int64) // 8, np.int64(total // 8))
    lens = np.diff(w_starts)
    if (lens < 0).any():
        raise ValueError("region_sums: region starts must be increasing and end by total")
    n_blk = (lens + BLOCK_WORDS - 1) // BLOCK_WORDS
    nonempty = np.flatnonzero(n_blk)
    first_all = np.cumsum(n_blk) - n_blk
    region = np.repeat(np.arange(len(lens)), n_blk)
    local = np.arange(int(n_blk.sum()), dtype=np.int64) - first_all[region]
    bst = w_starts[region] + local * BLOCK_WORDS
    bend = np.minimum(bst + BLOCK_WORDS, w_starts[region + 1])
    return Layout(w_starts, nonempty, bst, bend, first_all[nonempty], local.astype(np.uint64), region)


def _table(rows: list[np.ndarray], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(r, dtype=np.int64) for r in rows])).to(device)


@functools.lru_cache(maxsize=64)
def bucket_table(starts: tuple[int, ...], total: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Copy (and sum) one bucket word for word: rows relative to the source, destination, sums and
    expected-sums bases. Also returns whether every block starts 64-byte aligned (every region does,
    as in a bucket)."""
    lay = block_layout(starts, total)
    n, idx = lay.bend - lay.bst, np.arange(len(lay.bst))
    return _table([lay.bst, n, lay.bst, n, idx, idx], device), all(s % ALIGN == 0 for s in starts)


@functools.lru_cache(maxsize=256)
def gather_table(addrs: tuple[int, ...], nbytes: tuple[int, ...], starts: tuple[int, ...], total: int,
                 device: torch.device) -> torch.Tensor:
    """Flatten tensors at byte addresses ``addrs`` (multiples of :data:`ALIGN`) of ``nbytes`` each
    (multiples of 8) into one bucket with regions ``starts``: the source row is absolute (source base
    0), the rest relative to the bucket's and its sums' bases; a region's alignment gap reads as zeros."""
    lay = block_layout(starts, total)
    into = lay.bst - lay.w_starts[lay.region]  # words into the block's region
    length = lay.bend - lay.bst
    src_word = np.asarray(addrs, dtype=np.int64)[lay.region] // 8 + into
    n_src = np.clip(np.asarray(nbytes, dtype=np.int64)[lay.region] // 8 - into, 0, length)
    idx = np.arange(len(lay.bst))
    return _table([src_word, n_src, lay.bst, length, idx, idx], device)


def gather_addresses(tensors, device: torch.device) -> tuple[int, ...] | None:
    """Source addresses for :func:`gather_table`, or ``None`` unless every tensor is contiguous on
    ``device`` at an :data:`ALIGN`-byte aligned address (as every allocation) with a whole number of
    8-byte words."""
    addrs = []
    for t in tensors:
        a = t.data_ptr()
        if t.device != device or a % ALIGN or (t.numel() * t.element_size()) % 8 or not t.is_contiguous():
            return None
        addrs.append(a)
    return tuple(addrs)


@functools.lru_cache(maxsize=8)
def version_table(buckets: tuple[tuple[int, int, int, tuple[int, ...], int], ...],
                  device: torch.device) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """Copy every bucket of a version in one launch. ``buckets``: per bucket ``(source address,
    destination address, address of the sender's block sums, region starts, nbytes)``. Source,
    destination and expected-sums rows are absolute (bases 0); the sums row indexes one
    ``int64 [n_blocks]`` buffer for the whole version. Returns the table, each bucket's first block
    (and the total as the last entry), and whether every block is 64-byte aligned."""
    rows: list[list[np.ndarray]] = [[] for _ in range(6)]
    first, aligned = [0], True
    for src, dst, expect, starts, nbytes in buckets:
        lay = block_layout(starts, nbytes)
        n = lay.bend - lay.bst
        local = np.arange(len(lay.bst), dtype=np.int64)
        for row, r in zip(rows, (src // 8 + lay.bst, n, dst // 8 + lay.bst, n, first[-1] + local,
                                 expect // 8 + local)):
            row.append(r)
        first.append(first[-1] + len(lay.bst))
        aligned &= src % ALIGN == 0 and dst % ALIGN == 0 and all(s % ALIGN == 0 for s in starts)
    cat = [np.concatenate(r) if r else np.zeros(0, np.int64) for r in rows]
    return _table(cat, device), tuple(first), aligned
