"""The one integrity scheme of the adapter sync: block sums for the bytes, BLAKE2b for the metadata.

Bytes. A bucket is a flat ``uint8`` buffer cut into tensor regions (``starts``, multiples of 8 bytes,
the last region ending at ``total``). Each region is read as little-endian 64-bit words and cut into
blocks of :data:`BLOCK_WORDS` words from the region's start; a **block sum** is the sum of a block's
words mod 2^64. Block sums are the unit every side computes and compares:

* on the CPU with numpy's ``add.reduceat`` over the buffer's memory (:func:`copy_block_sums`);
* on a GPU with the Triton kernel :func:`kimi_core.kernels.block_sums.copy_sum_blocks`, which gives
  the same numbers and can fuse them into a copy and a compare with the sender's sums (the CUDA-IPC
  transport's check).

A **tensor sum** (:func:`region_sums`, the per-tensor number a manifest carries) is derived from its
region's block sums: each block sum times an odd weight ``(2k + 1) * 0x9E3779B97F4A7C15 | 1`` (``k``
the block's index in the region), added mod 2^64, plus the region's word count, then the splitmix64
finaliser. One flipped byte changes one word by ``v * 2^(8j)`` with ``0 < |v| < 256``; an odd weight
keeps that nonzero mod 2^64, so it is always detected; swapped blocks change the weights.

Metadata. Names, dtypes, shapes, offsets and tensor sums are small: they are covered by
:func:`json_digest` (BLAKE2b-128 of the canonical JSON), and a framed binary manifest by
:func:`digest`. A keyless digest detects damage and truncation, not a forger: a manifest comes from a
trusted trainer.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "BLOCK_WORDS",
    "Layout",
    "block_layout",
    "copy_block_sums",
    "copy_region_sums",
    "digest",
    "first_bad_region",
    "json_digest",
    "n_blocks",
    "region_sums",
    "starts_key",
]

ALIGN = 64  # every tensor region starts at a multiple of ALIGN bytes
BLOCK_WORDS = 4096  # 32 KiB blocks: one GPU program each; see docs/performance.md#adapter-sync

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Layout(NamedTuple):
    """Word-level block partition of a bucket's regions (see :func:`block_layout`)."""

    w_starts: np.ndarray  # int64 [R+1]: region word boundaries
    nonempty: np.ndarray  # indices of regions with at least one word
    bst: np.ndarray  # int64 [n_blocks]: each block's first word
    bend: np.ndarray  # int64 [n_blocks]: one past its last word
    first_block: np.ndarray  # each nonempty region's first block
    local: np.ndarray  # uint64 [n_blocks]: the block's position inside its region
    region: np.ndarray  # int64 [n_blocks]: the block's region


def starts_key(starts) -> tuple[int, ...]:
    """``starts`` as a hashable cache key (a tuple is used as it is: thousands of regions per bucket)."""
    return starts if type(starts) is tuple else tuple(int(x) for x in starts)


def block_layout(starts, total: int) -> Layout:
    """Block partition of the byte regions ``[starts[i], starts[i+1])`` (the last ends at ``total``); cached."""
    return _layout(starts_key(starts), int(total))


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


def n_blocks(starts, total: int) -> int:
    """How many blocks a bucket with regions ``starts`` and ``total`` bytes has."""
    return len(block_layout(starts, total).bst)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (a bijection: it cannot hide a difference)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _combine(sums: np.ndarray, layout: Layout) -> list[int]:
    """Tensor sums from the block sums (``uint64 [n_blocks]``) of :func:`block_layout`."""
    mixed = np.zeros(len(layout.w_starts) - 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        if len(layout.nonempty):
            weights = (layout.local * np.uint64(2) + np.uint64(1)) * _GOLDEN | np.uint64(1)
            mixed[layout.nonempty] = np.add.reduceat(sums * weights, layout.first_block)
        mixed = mixed + np.diff(layout.w_starts).astype(np.uint64)
    return [int(v) for v in _mix(mixed)]


def copy_block_sums(
    src: torch.Tensor,
    dst: torch.Tensor | None,
    starts,
    total: int | None = None,
    *,
    expect: torch.Tensor | None = None,
    flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block sums of ``src`` (``uint8 [>= total]``) as ``int64 [n_blocks]`` (bits = the unsigned sums)
    on the checking device, copying the first ``total`` bytes to ``dst`` on the way when given.

    On one CUDA device the copy and the sums are one kernel launch; nothing waits for it. ``expect`` (the
    sender's ``int64 [n_blocks]`` sums) with ``flag`` (``int32 []`` on the checking device) compares in the
    same launch and sets ``flag`` to 1 on a mismatch: synchronise once, read ``flag``. Across GPUs (a
    peer's IPC buffer): a copy, then the sums of the local copy, since kernel loads from a peer's IPC
    mapping are not supported everywhere. On the CPU: a copy, then numpy's ``add.reduceat``.
    """
    total = src.numel() if total is None else total
    for name, t in (("src", src), ("dst", dst)):  # the kernel writes through raw addresses
        if t is not None and (t.dtype != torch.uint8 or not t.is_contiguous() or t.numel() < total):
            raise ValueError(
                f"copy_block_sums: {name} must be contiguous uint8 of >= {total} bytes, got {t.dtype} {tuple(t.shape)}"
            )
    dev = (dst if dst is not None else src).device
    if dev.type == "cuda" and src.device == dev:
        from kimi_core.kernels.block_sums import copy_sum_blocks
        from kimi_core.sync.block_tables import bucket_table

        table, aligned = bucket_table(starts_key(starts), int(total), dev)
        sums = torch.empty(table.shape[1], dtype=torch.int64, device=dev)
        if expect is not None and (expect.numel() != sums.numel() or expect.dtype != torch.int64):
            raise ValueError(
                f"copy_block_sums: expect must be int64 [{sums.numel()}], got {expect.dtype} [{expect.numel()}]"
            )
        if expect is not None and expect.device != dev:
            expect = expect.to(dev)
        copy_sum_blocks(
            table,
            BLOCK_WORDS,
            src_base=src.data_ptr(),
            dst_base=None if dst is None else dst.data_ptr(),
            sums_base=sums.data_ptr(),
            expect_base=None if expect is None else expect.data_ptr(),
            flag=flag,
            aligned=aligned,
        )
        return sums
    if dst is not None:
        if dst.device.type == "cpu" and src.device.type == "cpu":
            np.copyto(dst.numpy()[:total], src.numpy()[:total])
        else:
            dst[:total].copy_(src[:total])
        return copy_block_sums(dst, None, starts, total, expect=expect, flag=flag)
    if src.device.type == "cuda":  # reached only through the copy above: src is now local
        return copy_block_sums(src, None, starts, total, expect=expect, flag=flag)
    layout = block_layout(starts, total)
    words = src.numpy()[:total].view(np.uint64)
    # regions are contiguous, so reduceat's "up to the next index" is "up to the end of this block"
    sums = np.add.reduceat(words, layout.bst) if len(layout.bst) else np.zeros(0, np.uint64)
    out = torch.from_numpy(sums.view(np.int64))
    if expect is not None:
        flag |= (out != expect.cpu()).any().to(flag.dtype)
    return out


def region_sums(buffer: torch.Tensor | np.ndarray, starts, total: int | None = None) -> list[int]:
    """The tensor sum (64-bit) of each byte region ``[starts[i], starts[i+1])`` (the last ends at ``total``).

    ``buffer`` is a ``uint8`` tensor (CPU or CUDA) or array whose length and ``starts`` are multiples of 8.
    """
    if isinstance(buffer, np.ndarray):
        buffer = torch.from_numpy(buffer)
    return copy_region_sums(buffer, None, starts, total)


def copy_region_sums(src: torch.Tensor, dst: torch.Tensor | None, starts, total: int | None = None) -> list[int]:
    """:func:`region_sums` of ``src``, copying it to ``dst`` on the way (:func:`copy_block_sums`)."""
    total = src.numel() if total is None else total
    sums = copy_block_sums(src, dst, starts, total)
    return _combine(sums.cpu().numpy().view(np.uint64), block_layout(starts, total))


def first_bad_region(got: torch.Tensor, sent: torch.Tensor, starts, total: int) -> int | None:
    """Index of the region holding the first block whose sums differ (``got`` vs ``sent``, both
    ``int64 [n_blocks]``), or ``None`` if all agree. Host-side; only called once something differs."""
    got, sent = got.cpu(), sent.cpu()
    if got.shape != sent.shape:
        return 0
    diff = torch.nonzero(got != sent).flatten()
    if not len(diff):
        return None
    return int(block_layout(starts, total).region[int(diff[0])])


def digest(data: bytes) -> bytes:
    """BLAKE2b-128 of ``data`` (16 bytes): the check of a framed binary manifest."""
    return hashlib.blake2b(data, digest_size=16).digest()


def json_digest(obj) -> str:
    """BLAKE2b-128 (hex) of ``obj``'s canonical JSON (sorted keys): the check of a metadata record."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()
