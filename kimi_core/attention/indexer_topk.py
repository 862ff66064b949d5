"""Blockwise top-k of the K3.1 DSA indexer scores: a running top-k over key blocks, never ``S x S``.

For each query block the scores ``I [B, bq, bk]`` of one key block at a time come from
``kimi_core.reference.indexer.index_scores`` (the formula lives there); keys a query cannot see
(later positions, another packed sequence) score ``-inf``; the block's scores are merged with the
running ``[B, bq, K]`` best and cut back to ``K``. The selected set equals
``kimi_core.reference.indexer.topk_mask`` on the dense scores (its naive twin), up to ties.
Memory: ``O(S * K)`` indices plus one ``[B, bq, n_h, bk]`` block.
"""

from __future__ import annotations

import torch

from kimi_core.attention.blockwise import key_starts
from kimi_core.reference.indexer import index_scores
from kimi_core.reference.ops import acc_dtype

__all__ = ["INDEX_BLOCK_K", "INDEX_BLOCK_Q", "blockwise_index_topk"]

# 256 queries x 1024 keys x n_h=64 heads: a 64 MiB fp32 ReLU block, and few loop steps / top-k merges per row.
INDEX_BLOCK_Q = 256
INDEX_BLOCK_K = 1024


@torch.no_grad()
def blockwise_index_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    seg: torch.Tensor | None = None,
    block_q: int = INDEX_BLOCK_Q,
    block_k: int = INDEX_BLOCK_K,
) -> torch.Tensor:
    """Indices ``[B, T, min(topk, T)]`` int64 of each query's highest-scoring visible keys, ``-1`` in empty slots.

    :param q: ``[B, T, n_h, d]`` index queries; ``k``: ``[B, T, d]`` index keys; ``weights``: ``[B, T, n_h]``
        raw ``weights_proj(x)`` (as :func:`kimi_core.reference.indexer.index_scores` takes them).
    :param seg: optional ``[T]`` segment ids of packed sequences: keys of other sequences are invisible.
    Query ``t`` sees keys ``s <= t`` (of its segment); with fewer visible keys than ``K`` the rest are ``-1``.
    """
    B, T = q.shape[:2]
    K = min(topk, T)
    dev, a = q.device, acc_dtype(q.dtype)
    out = torch.empty(B, T, K, dtype=torch.int64, device=dev)
    for q0, k_start in zip(range(0, T, block_q), key_starts(seg, T, block_q)):
        q1 = min(q0 + block_q, T)
        best_v = torch.full((B, q1 - q0, K), float("-inf"), device=dev, dtype=a)
        best_i = torch.full((B, q1 - q0, K), -1, dtype=torch.int64, device=dev)
        qi = torch.arange(q0, q1, device=dev)[:, None]
        for k0 in range(k_start, q1, block_k):
            k1 = min(k0 + block_k, q1)
            s = index_scores(q[:, q0:q1], k[:, k0:k1], weights[:, q0:q1])  # [B, bq, bk]
            ki = torch.arange(k0, k1, device=dev)[None, :]
            keep = ki <= qi
            if seg is not None:
                keep = keep & (seg[q0:q1, None] == seg[None, k0:k1])
            s = s.to(best_v.dtype).masked_fill(~keep, float("-inf"))
            vals = torch.cat([best_v, s], -1)
            ids = torch.cat([best_i, ki.expand(B, q1 - q0, -1)], -1)
            best_v, pick = vals.topk(K, dim=-1)
            best_i = ids.gather(-1, pick)
        out[:, q0:q1] = best_i.masked_fill(best_v == float("-inf"), -1)
    return out
