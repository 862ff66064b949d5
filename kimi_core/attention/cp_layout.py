"""Context parallelism's load-balanced token layout: which global positions a CP rank holds, in its local order.

Causal attention costs more for later tokens, so a sequence of ``L`` tokens is cut into ``2 * cp`` equal chunks
and rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r`` (rank 0 the first and the last chunk).
Unpacked ``[B, S]`` batches split every row that way (NVIDIA/Megatron-LM:megatron/training/utils.py
``get_batch_on_this_cp_rank``); packed THD batches split each sequence on its own, by its padded length, and
concatenate the pieces in sequence order (TransformerEngine's THD context parallelism, as
NovaSky-AI/SkyRL:skyrl/backends/skyrl_train/distributed/megatron/megatron_utils.py ``preprocess_packed_seqs``
lays tokens out). In both cases the local positions are non-decreasing, and a rank's local length is the global
one divided by ``cp``.
"""

from __future__ import annotations

import torch

__all__ = ["load_balanced_positions"]


def _chunks(start: int, length: int, cp: int, rank: int) -> list[torch.Tensor]:
    c = length // (2 * cp)
    return [
        torch.arange(start + rank * c, start + (rank + 1) * c),
        torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c),
    ]


def load_balanced_positions(
    cp_size: int, cp_rank: int, seq_len: int | None = None, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Global positions ``[L / cp]`` int64 (on the CPU) of the tokens CP rank ``cp_rank`` holds, in its local order.

    :param seq_len: global length of an unpacked sequence (each row of ``[B, S]``); a multiple of ``2 * cp_size``.
    :param cu_seqlens: ``[N + 1]`` global (padded) cumulative lengths of a packed THD batch, each sequence's length
        a multiple of ``2 * cp_size``; exactly one of ``seq_len`` and ``cu_seqlens`` is given.
    """
    if (seq_len is None) == (cu_seqlens is None):
        raise ValueError("load_balanced_positions: pass exactly one of seq_len and cu_seqlens")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"load_balanced_positions: cp_rank {cp_rank} outside context-parallel size {cp_size}")
    if seq_len is not None:
        if seq_len % (2 * cp_size):
            raise ValueError(
                f"context parallelism: sequence length {seq_len} is not a multiple of 2 * --context-parallel-size "
                f"= {2 * cp_size} (megatron's load-balanced split)"
            )
        return torch.cat(_chunks(0, seq_len, cp_size, cp_rank))
    bounds = [int(b) for b in cu_seqlens.tolist()]
    lens = [e - s for s, e in zip(bounds, bounds[1:])]
    bad = [n for n in lens if n % (2 * cp_size)]
    if bad:
        raise ValueError(
            f"context parallelism: packed sequence lengths {bad} (packed_seq_params.cu_seqlens_q_padded) are not "
            f"multiples of 2 * --context-parallel-size = {2 * cp_size}; pad each sequence (as SkyRL's "
            "preprocess_packed_seqs does)"
        )
    parts = [p for s, n in zip(bounds, lens) for p in _chunks(s, n, cp_size, cp_rank)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
