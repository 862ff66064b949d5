"""The block sums of :mod:`kimi_core.sync.checksum` on a CUDA device: one Triton program per block.

The same program can

* store the words it read at the block's destination (the checksum rides in the copy: one read,
  one write);
* read and write each block at its own addresses (absolute rows in the table), so flattening many
  tensors into a bucket, or copying every bucket of an adapter version, is one launch;
* compare each sum with the sender's (``expect_base``) and raise a device flag, so a receiver
  synchronises once per adapter version, not once per bucket.

Every address must be memory of the launch device (a cross-GPU receiver copies first).

Block table (``int64 [6, n_blocks]`` on the launch device, built in :mod:`kimi_core.sync.block_tables`):
per block the source word, how many words to read from the source (the rest of the block reads as zero:
a tensor's alignment gap), the destination word, the block length in words (``<= BLOCK``), the word of
its sum, the word of the sender's sum; the byte address of row r is ``base_r + 8 * row``, with each base
a launch argument (0 for absolute rows), so one launch can span many tensors or many buckets. Sums are
``int64`` whose bits are the unsigned sums (Triton's 64-bit adds wrap). The torch reference is the CPU
path of :func:`kimi_core.sync.checksum.copy_block_sums`.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CHUNK_WORDS", "NUM_WARPS", "STREAM_HINTS", "copy_sum_blocks"]

# launch shape and cache hints: `benchmarks/adapter_sync.py cuda-ipc --tune`; see docs/performance.md#adapter-sync
CHUNK_WORDS = 4096
NUM_WARPS = 4
STREAM_HINTS = True

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy_sum_blocks(
            table,
            n_blocks,
            src_base,
            dst_base,
            sums_base,
            expect_base,
            flag,
            COPY: tl.constexpr,
            SUMS: tl.constexpr,
            CHECK: tl.constexpr,
            BLOCK: tl.constexpr,
            CHUNK: tl.constexpr,
            ALIGNED: tl.constexpr,
            LOAD_EVICT: tl.constexpr,
            STORE_CACHE: tl.constexpr,
        ):
            blk = tl.program_id(0)
            src_word = tl.load(table + blk)
            n_src = tl.load(table + n_blocks + blk)
            dst_word = tl.load(table + 2 * n_blocks + blk)
            length = tl.load(table + 3 * n_blocks + blk)
            if ALIGNED:  # 64-byte aligned blocks: 16-byte vector loads and stores
                src_word = tl.multiple_of(src_word, 8)
                dst_word = tl.multiple_of(dst_word, 8)
            src = (src_base + src_word * 8).to(tl.pointer_type(tl.int64))
            dst = (dst_base + dst_word * 8).to(tl.pointer_type(tl.int64))
            acc = tl.zeros([CHUNK], dtype=tl.int64)
            if (n_src == BLOCK) & (length == BLOCK):  # a whole block of the source: no masks
                for c in tl.static_range(0, BLOCK, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    x = tl.load(src + offs, eviction_policy=LOAD_EVICT)
                    if COPY:
                        tl.store(dst + offs, x, cache_modifier=STORE_CACHE)
                    acc += x
            else:  # a tensor's last block, its alignment gap reads as zeros
                for c in tl.static_range(0, BLOCK, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    x = tl.load(src + offs, mask=offs < n_src, other=0)
                    if COPY:
                        tl.store(dst + offs, x, mask=offs < length)
                    acc += x
            if SUMS:
                s = tl.sum(acc, axis=0)
                tl.store((sums_base + tl.load(table + 4 * n_blocks + blk) * 8).to(tl.pointer_type(tl.int64)), s)
                if CHECK:
                    e = tl.load((expect_base + tl.load(table + 5 * n_blocks + blk) * 8).to(tl.pointer_type(tl.int64)))
                    if s != e:  # only a mismatch writes: an atomic per block serialises on one address
                        tl.store(flag, 1)

        _KERNEL = _copy_sum_blocks
    return _KERNEL


def copy_sum_blocks(
    table: torch.Tensor,
    block_words: int,
    *,
    src_base: int,
    dst_base: int | None = None,
    sums_base: int | None = None,
    expect_base: int | None = None,
    flag: torch.Tensor | None = None,
    aligned: bool = False,
    chunk_words: int | None = None,
    num_warps: int | None = None,
    stream_hints: bool | None = None,
) -> None:
    """Launch one program per block of ``table`` (see the module docstring) on ``table``'s device.

    Each ``*_base`` is a byte address (``tensor.data_ptr()``, or ``0`` where the table's row is
    absolute); ``None`` switches that part off.

    :param src_base: source words (row 0).
    :param dst_base: where to copy the words (row 2); ``None``: sums only.
    :param sums_base: ``int64`` block sums out (row 4); ``None``: copy only.
    :param expect_base: the sender's ``int64`` block sums (row 5); each mismatch sets ``flag``
        (``int32 []`` on the launch device) to 1. Needs ``sums_base``.
    :param aligned: rows 0 and 2 are multiples of 8 words and the bases of 64 bytes (whole blocks
        then copy with unmasked 16-byte vector accesses).
    :param chunk_words, num_warps, stream_hints: launch shape and cache hints (defaults
        :data:`CHUNK_WORDS`, :data:`NUM_WARPS`, :data:`STREAM_HINTS`).
    """
    n = table.shape[1]
    if table.dtype != torch.int64 or table.ndim != 2 or table.shape[0] != 6:
        raise ValueError(f"copy_sum_blocks: table must be int64 [6, n_blocks], got {table.dtype} {tuple(table.shape)}")
    if flag is not None and (flag.dtype != torch.int32 or flag.device != table.device):
        raise ValueError(f"copy_sum_blocks: flag must be int32 on {table.device}, got {flag.dtype} on {flag.device}")
    if (expect_base is None) != (flag is None) or (expect_base is not None and sums_base is None):
        raise ValueError("copy_sum_blocks: expect_base and flag go together, and need sums_base")
    if n == 0 or (dst_base is None and sums_base is None):
        return
    aligned = aligned and src_base % 64 == 0 and (dst_base or 0) % 64 == 0
    stream = STREAM_HINTS if stream_hints is None else stream_hints
    # CPU tensors only under TRITON_INTERPRET=1 (the tests); addresses are then host memory
    with torch.cuda.device(table.device) if table.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[(n,)](
            table,
            n,
            src_base,
            dst_base or 0,
            sums_base or 0,
            expect_base or 0,
            flag if flag is not None else table,
            COPY=dst_base is not None,
            SUMS=sums_base is not None,
            CHECK=flag is not None,
            BLOCK=block_words,
            CHUNK=min(chunk_words or CHUNK_WORDS, block_words),
            ALIGNED=aligned,
            num_warps=num_warps or NUM_WARPS,
            # streaming: read once, written for another process: keep both out of L2
            **(dict(LOAD_EVICT="evict_first", STORE_CACHE=".cs") if stream else dict(LOAD_EVICT="", STORE_CACHE="")),
        )
