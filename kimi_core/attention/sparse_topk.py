"""Sparse attention over per-query top-k key indices (K3.1 DSA): gather, no ``S x S`` mask.

Query ``t`` attends only the keys ``idx[t, :]`` the frozen indexer picked (``-1`` = empty slot)::

    o_t = sum_j softmax_j(scale * q_t . k_{idx[t, j]}) v_{idx[t, j]}

the same result as the dense ``kimi_core.reference.mla`` attention with the top-k keep-mask of
``kimi_core.reference.indexer.topk_mask`` (its naive twin). Queries are processed in blocks whose
gathered keys stay under :data:`GATHER_ELEMENTS`; forward saves the output and the log-sum-exp, and
backward recomputes each block's probabilities and scatters ``dk``/``dv`` back with an index-add, so
memory is ``O(S * (k + n * d))``. Logits and accumulators in fp32 (fp64 for fp64 inputs).

On CUDA (:func:`kimi_core.attention.uses_fused_attention`) the gather, whose traffic is
``S * k * n * d``, gives way to torch's fused SDPA over :data:`SDPA_BLOCK_Q` queries at a time with a
boolean mask scattered from ``idx`` (``[bq, S]``, linear in S), each block under activation
checkpointing so the backward rebuilds the mask instead of keeping it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kimi_core.attention.causal import uses_fused_attention
from kimi_core.reference.ops import acc_dtype

__all__ = ["GATHER_ELEMENTS", "SDPA_BLOCK_Q", "sparse_topk_attention"]

# Gathered keys + values of one query block stay under 2^24 elements (64 MiB fp32): bounded, still large tiles.
GATHER_ELEMENTS = 1 << 24


# 1024 queries per SDPA call: a [1024, S] bool mask is 64 MiB at S = 64k, and 64 launches cover 64k tokens.
SDPA_BLOCK_Q = 1024


def _sdpa_block(q, k, v, idx, scale):
    """SDPA of one query block: ``q [B, n, bq, dqk]``, ``k``/``v [B, n, Sk, d]``, ``idx [B, bq, K]`` -> ``[B, n, bq, dv]``."""
    B, bq, _ = idx.shape
    Sk = k.shape[2]
    keep = torch.zeros(B, bq, Sk + 1, dtype=torch.bool, device=q.device)
    keep.scatter_(-1, idx.where(idx >= 0, Sk), True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :, :Sk], scale=scale)


def _sparse_sdpa(q, k, v, idx, scale, q_pos=None):
    """The CUDA path: ``[B, S, n, d]`` layout in and out, SDPA per query block under checkpointing.

    ``q_pos [S]``: non-decreasing key positions of the queries (a context-parallel rank's), default ``arange(S)``."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, n, S, d]
    S = q.shape[1]
    q0s = list(range(0, S, SDPA_BLOCK_Q))
    if q_pos is None:
        ends = [min(q0 + SDPA_BLOCK_Q, S) for q0 in q0s]
    else:  # one host sync: each block's last position + 1
        last = torch.tensor([min(q0 + SDPA_BLOCK_Q, S) - 1 for q0 in q0s], dtype=torch.int64, device=q_pos.device)
        ends = (q_pos[last] + 1).tolist() if q0s else []
    parts = []
    for q0, k_end in zip(q0s, ends):
        q1 = min(q0 + SDPA_BLOCK_Q, S)
        # keys past the block's last query are never selected under causal top-k: cut them off
        parts.append(
            checkpoint(
                _sdpa_block,
                qt[:, :, q0:q1],
                kt[:, :, :k_end],
                vt[:, :, :k_end],
                idx[:, q0:q1],
                scale,
                use_reentrant=False,
            )
        )
    return torch.cat(parts, dim=2).transpose(1, 2)


def _rows(K: int, n: int, d: int) -> int:
    return max(1, GATHER_ELEMENTS // max(1, K * n * d))


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t [B, Sk, n, d]``, ``idx [B, bq, K]`` (no negatives) -> ``[B, bq, K, n, d]``."""
    b = torch.arange(t.shape[0], device=t.device)[:, None, None]
    return t[b, idx]


class _SparseTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, scale):
        # q [B, S, n, dqk], k [B, Sk, n, dqk], v [B, Sk, n, dv], idx [B, S, K]
        a = acc_dtype(q.dtype)
        B, S, n, dqk = q.shape
        K = idx.shape[-1]
        rows = _rows(K, n, dqk + v.shape[-1])
        out = torch.empty(B, S, n, v.shape[-1], device=q.device, dtype=a)
        lse = torch.empty(B, S, n, device=q.device, dtype=a)
        for q0 in range(0, S, rows):
            q1 = min(q0 + rows, S)
            ib = idx[:, q0:q1]
            valid = ib >= 0
            safe = ib.clamp_min(0)
            s = torch.einsum("bqnd,bqknd->bqnk", q[:, q0:q1].to(a), _gather(k, safe).to(a)) * scale
            s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
            lse_b = torch.logsumexp(s, -1)  # [B, bq, n]
            p = torch.exp(s - lse_b[..., None])
            out[:, q0:q1] = torch.einsum("bqnk,bqknd->bqnd", p, _gather(v, safe).to(a))
            lse[:, q0:q1] = lse_b
        ctx.save_for_backward(q, k, v, idx, out, lse)
        ctx.scale, ctx.rows = scale, rows
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, idx, out, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        a = out.dtype
        B, S, n, _ = q.shape
        do = dout.to(a)
        delta = (do * out).sum(-1)  # [B, S, n]
        dq = torch.zeros_like(q, dtype=a)
        dk = torch.zeros_like(k, dtype=a)
        dv = torch.zeros_like(v, dtype=a)
        bidx = torch.arange(B, device=q.device)[:, None, None]
        for q0 in range(0, S, rows):
            q1 = min(q0 + rows, S)
            ib = idx[:, q0:q1]
            valid = ib >= 0
            safe = ib.clamp_min(0)
            kg, vg = _gather(k, safe).to(a), _gather(v, safe).to(a)
            qb, dob = q[:, q0:q1].to(a), do[:, q0:q1]
            s = torch.einsum("bqnd,bqknd->bqnk", qb, kg) * scale
            s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
            p = torch.exp(s - lse[:, q0:q1, :, None])  # [B, bq, n, K]; 0 on empty slots
            dv.index_put_((bidx, safe), torch.einsum("bqnk,bqnd->bqknd", p, dob), accumulate=True)
            dp = torch.einsum("bqnd,bqknd->bqnk", dob, vg)
            ds = p * (dp - delta[:, q0:q1, :, None]) * scale
            dq[:, q0:q1] = torch.einsum("bqnk,bqknd->bqnd", ds, kg)
            dk.index_put_((bidx, safe), torch.einsum("bqnk,bqnd->bqknd", ds, qb), accumulate=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sparse_topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its selected keys: ``[B, S, n, dv]`` in ``q``'s dtype.

    :param q: ``[B, S, n, dqk]``; ``k``: ``[B, Sk, n, dqk]``; ``v``: ``[B, Sk, n, dv]``.
    :param idx: ``[B, S, K]`` int64 key positions per query, ``-1`` for an empty slot; every query needs
        at least one valid slot (its own position, under causal top-k selection).
    :param scale: softmax scale applied to ``q . k``.
    :param q_pos: optional ``[S]`` non-decreasing key positions of the queries (a context-parallel rank's queries
        against the gathered keys); lets the fused path cut each block's keys at its last position.
    Differentiable in ``q``, ``k``, ``v``. Self-attention (or ``q_pos`` given) on CUDA with ``idx`` selecting only
    keys at or before each query (the indexer's causal top-k) takes the fused SDPA path.
    """
    if idx.shape[:2] != q.shape[:2]:
        raise ValueError(f"sparse_topk_attention: idx {tuple(idx.shape)} does not match q {tuple(q.shape)}")
    if uses_fused_attention(q) and (q_pos is not None or q.shape[1] == k.shape[1]):
        return _sparse_sdpa(q, k, v, idx.to(torch.int64), scale, q_pos)
    return _SparseTopk.apply(q, k, v, idx.to(torch.int64), scale)
