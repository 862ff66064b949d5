"""GPU block sums for bucket checksums, fused into the copy that moves the bytes.

:func:`kimi_core.lora.buckets.region_sums` cuts every tensor region of a bucket into blocks of
``BLOCK_WORDS`` little-endian 64-bit words and sums each block mod 2^64. This module computes those
block sums on a CUDA device with one Triton program per block, and the same program can

* store the words it read into ``dst`` (the checksum rides in the copy: one read, one write);
* gather: read each block from its own address (``src_base=0``, absolute word addresses in the
  table), so flattening many tensors into a bucket and summing it is one launch;
* compare each sum with the sender's (``expect_base``) and raise a device flag, so a receiver
  synchronises once per adapter version, not once per bucket.

Every address must be memory of the launch device: loads from a peer GPU's IPC-mapped buffer
fault on H200 (measured), so a cross-GPU receiver copies first.

Block table (``int64 [4, n_blocks]`` on the launch device): row 0 the source word index of the
block's first word (byte address ``src_base + 8 * row0``), row 1 how many words to read from the
source (the rest of the block reads as zero: a tensor's alignment gap), row 2 the destination word
index, row 3 the block length in words (``<= BLOCK``). Sums are ``int64`` whose bits are the
unsigned sums (Triton's 64-bit adds wrap).

Launch shape: ``CHUNK_WORDS`` words per load step and ``NUM_WARPS`` warps per program, chosen by
``benchmarks/cuda_ipc_sync.py --tune`` on an H200 (RESULTS.md; one program per block beat fewer
programs looping over blocks, and a sums pass beside a copy-engine transfer hides behind it at full
width).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CHUNK_WORDS", "NUM_WARPS", "copy_sum_blocks"]

CHUNK_WORDS = 2048
NUM_WARPS = 8

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy_sum_blocks(src_base, table, n_blocks, dst, sums, expect_base, flag, COPY: tl.constexpr,
                             SUMS: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                             ALIGNED: tl.constexpr):
            blk = tl.program_id(0)
            src_word = tl.load(table + blk)
            n_src = tl.load(table + n_blocks + blk)
            d0 = tl.load(table + 2 * n_blocks + blk)
            length = tl.load(table + 3 * n_blocks + blk)
            if ALIGNED:  # 64-byte aligned blocks: 16-byte vector loads and stores
                src_word = tl.multiple_of(src_word, 8)
                d0 = tl.multiple_of(d0, 8)
            src = (src_base + src_word * 8).to(tl.pointer_type(tl.int64))
            acc = tl.zeros([CHUNK], dtype=tl.int64)
            if (n_src == BLOCK) & (length == BLOCK):  # a whole block of the source: no masks
                for c in tl.static_range(0, BLOCK, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    x = tl.load(src + offs)
                    if COPY:
                        tl.store(dst + d0 + offs, x)
                    acc += x
            else:  # a tensor's last block, its alignment gap reads as zeros
                for c in tl.static_range(0, BLOCK, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    x = tl.load(src + offs, mask=offs < n_src, other=0)
                    if COPY:
                        tl.store(dst + d0 + offs, x, mask=offs < length)
                    acc += x
            if SUMS:
                s = tl.sum(acc, axis=0)
                tl.store(sums + blk, s)
                if CHECK:
                    e = tl.load((expect_base + blk * 8).to(tl.pointer_type(tl.int64)))
                    tl.atomic_max(flag, (s != e).to(tl.int32))

        _KERNEL = _copy_sum_blocks
    return _KERNEL


def copy_sum_blocks(table: torch.Tensor, block_words: int, *, src_base: int, dst: torch.Tensor | None = None,
                    sums: torch.Tensor | None = None, expect_base: int | None = None,
                    flag: torch.Tensor | None = None, aligned: bool = False, chunk_words: int | None = None,
                    num_warps: int | None = None) -> None:
    """Launch one program per block of ``table`` (see the module docstring) on ``table``'s device.

    :param src_base: byte address of source word 0 (``src.data_ptr()``; ``0`` for a gather table).
    :param dst: ``int64`` 1-D words to copy into (``None``: sums only).
    :param sums: ``int64 [n_blocks]`` output (``None``: copy only).
    :param expect_base: byte address of the sender's ``int64 [n_blocks]`` sums; each mismatch sets
        ``flag`` (``int32 []``, on the launch device) to 1. Needs ``sums``.
    :param aligned: rows 0 and 2 of ``table`` are multiples of 8 words (whole blocks then copy with
        unmasked 16-byte vector accesses, when the base addresses are 64-byte aligned too).
    :param chunk_words, num_warps: launch shape (defaults :data:`CHUNK_WORDS`, :data:`NUM_WARPS`).
    """
    n = table.shape[1]
    if table.dtype != torch.int64 or table.ndim != 2 or table.shape[0] != 4:
        raise ValueError(f"copy_sum_blocks: table must be int64 [4, n_blocks], got {table.dtype} {tuple(table.shape)}")
    for name, t, dt in (("dst", dst, torch.int64), ("sums", sums, torch.int64), ("flag", flag, torch.int32)):
        if t is not None and (t.dtype != dt or t.device != table.device):
            raise ValueError(f"copy_sum_blocks: {name} must be {dt} on {table.device}, got {t.dtype} on {t.device}")
    if sums is not None and sums.numel() < n:
        raise ValueError(f"copy_sum_blocks: sums has {sums.numel()} elements for {n} blocks")
    if (expect_base is None) != (flag is None) or (expect_base is not None and sums is None):
        raise ValueError("copy_sum_blocks: expect_base and flag go together, and need sums")
    if n == 0 or (dst is None and sums is None):
        return
    aligned = aligned and src_base % 64 == 0 and (dst is None or dst.data_ptr() % 64 == 0)
    # CPU tensors only under TRITON_INTERPRET=1 (the tests); addresses are then host memory
    with torch.cuda.device(table.device) if table.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[(n,)](src_base, table, n, dst if dst is not None else table, sums if sums is not None else table,
                        expect_base or 0, flag if flag is not None else table, COPY=dst is not None,
                        SUMS=sums is not None, CHECK=flag is not None, BLOCK=block_words,
                        CHUNK=min(chunk_words or CHUNK_WORDS, block_words), ALIGNED=aligned,
                        num_warps=num_warps or NUM_WARPS)
