"""GPU block sums for bucket checksums, optionally fused into the copy that moves the bytes.

:func:`kimi_core.lora.buckets.region_sums` cuts every tensor region of a bucket into blocks of
``BLOCK_WORDS`` little-endian 64-bit words and sums each block mod 2^64; the blocks are then
weighted and mixed on the host (a few KB). This module computes the block sums on a CUDA device
with one Triton program per block. With ``dst`` given, the same program also stores the words it
read into ``dst``: the checksum rides in the copy (one read, one write), so checking a received
bucket costs no extra pass over memory. ``src`` may live on a peer GPU (an IPC-opened buffer):
the loads then travel over NVLink inside the kernel.

Shapes and dtypes: ``src`` / ``dst`` are 1-D ``int64`` views of the byte buffers; ``starts`` and
``ends`` are ``int64 [n_blocks]`` word indices (``ends[i] - starts[i] <= BLOCK_WORDS``); the result
is ``int64 [n_blocks]`` whose bits are the unsigned sums (Triton's 64-bit adds wrap).
"""

from __future__ import annotations

import torch

__all__ = ["block_sums"]


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _block_sums(src, dst, starts, ends, out, COPY: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNK: tl.constexpr):
            pid = tl.program_id(0)
            s = tl.load(starts + pid)
            e = tl.load(ends + pid)
            acc = tl.zeros([CHUNK], dtype=tl.int64)
            for c in tl.static_range(0, BLOCK, CHUNK):
                offs = s + c + tl.arange(0, CHUNK)
                mask = offs < e
                x = tl.load(src + offs, mask=mask, other=0)
                if COPY:
                    tl.store(dst + offs, x, mask=mask)
                acc += x
            tl.store(out + pid, tl.sum(acc, axis=0))

        _KERNEL = _block_sums
    return _KERNEL


def block_sums(src: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, block_words: int,
               dst: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``src[starts[i]:ends[i]]`` (int64 words, wrapping) for every block ``i``; copy them to
    ``dst`` at the same word indices when ``dst`` is given. Runs on ``dst``'s device (else ``src``'s).

    :param block_words: the block length (a power of two, >= every ``ends[i] - starts[i]``).
    """
    if src.dtype != torch.int64 or src.ndim != 1:
        raise ValueError(f"block_sums: src must be a 1-D int64 view, got {src.dtype} {tuple(src.shape)}")
    if dst is not None and (dst.dtype != torch.int64 or dst.ndim != 1 or dst.numel() < src.numel()):
        raise ValueError(f"block_sums: dst must be a 1-D int64 view of >= {src.numel()} words")
    dev = (dst if dst is not None else src).device
    out = torch.empty(starts.numel(), dtype=torch.int64, device=dev)
    if starts.numel() == 0:
        return out
    with torch.cuda.device(dev):
        _kernel()[(starts.numel(),)](src, dst if dst is not None else src, starts.to(dev), ends.to(dev), out,
                                     COPY=dst is not None, BLOCK=block_words,
                                     CHUNK=min(1024, block_words), num_warps=4)
    return out
