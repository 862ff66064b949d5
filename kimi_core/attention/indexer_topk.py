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

from kimi_core.attention.blockwise import block_ranges
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
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices ``[B, Tq, min(topk, Tk)]`` int64 of each query's highest-scoring visible keys, ``-1`` in empty slots.

    :param q: ``[B, Tq, n_h, d]`` index queries; ``k``: ``[B, Tk, d]`` index keys; ``weights``: ``[B, Tq, n_h]``
        raw ``weights_proj(x)`` (as :func:`kimi_core.reference.indexer.index_scores` takes them).
    :param seg: optional ``[Tk]`` segment ids of packed sequences: keys of other sequences are invisible.
    :param q_pos: optional ``[Tq]`` non-decreasing positions of the queries among the keys (a context-parallel
        rank's queries against the gathered keys); default: ``Tq == Tk``, query ``t`` at position ``t``.
    Query ``t`` sees keys ``s <= q_pos[t]`` (of its segment); with fewer visible keys than ``K`` the rest are ``-1``.
    """
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    K = min(topk, Tk)
    dev, a = q.device, acc_dtype(q.dtype)
    pos = torch.arange(Tq, device=dev) if q_pos is None else q_pos
    out = torch.empty(B, Tq, K, dtype=torch.int64, device=dev)
    for q0, q1, k_start, k_end in block_ranges(seg, Tq, Tk, block_q, q_pos):
        best_v = torch.full((B, q1 - q0, K), float("-inf"), device=dev, dtype=a)
        best_i = torch.full((B, q1 - q0, K), -1, dtype=torch.int64, device=dev)
        qi = pos[q0:q1, None]
        for k0 in range(k_start, k_end, block_k):
            k1 = min(k0 + block_k, k_end)
            s = index_scores(q[:, q0:q1], k[:, k0:k1], weights[:, q0:q1])  # [B, bq, bk]
            ki = torch.arange(k0, k1, device=dev)[None, :]
            keep = ki <= qi
            if seg is not None:
                keep = keep & (seg[qi] == seg[None, k0:k1])
            s = s.to(best_v.dtype).masked_fill(~keep, float("-inf"))
            vals = torch.cat([best_v, s], -1)
            ids = torch.cat([best_i, ki.expand(B, q1 - q0, -1)], -1)
            best_v, pick = vals.topk(K, dim=-1)
            best_i = ids.gather(-1, pick)
        out[:, q0:q1] = best_i.masked_fill(best_v == float("-inf"), -1)
    return out
