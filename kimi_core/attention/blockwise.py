"""Causal softmax attention over query / key blocks with an online softmax: memory linear in S.

``o_t = sum_s softmax_s(scale * q_t . k_s) v_s`` over the keys ``s <= t`` of the same sequence (packed
batches give every token a segment id; see :func:`segment_ids`). The same maths as the dense
``kimi_core.reference.mla`` attention (its naive twin), computed a ``[BLOCK_Q, BLOCK_K]`` tile at a time:

* forward keeps a running row max ``m``, row sum ``l`` and weighted sum ``acc`` per query block and saves
  only the output and the log-sum-exp ``lse = m + log l`` ``[B, n, S]``;
* backward recomputes each tile's probabilities ``exp(scale * q k^T - lse)`` and accumulates
  ``dq``, ``dk``, ``dv`` block by block, so activation memory is ``O(S * n * d)``, never ``O(S^2)``.

Logits, probabilities and the accumulators are in the accumulation dtype (fp32, fp64 for fp64 inputs);
the output is cast back to the input dtype.
"""

from __future__ import annotations

import torch

from kimi_core.reference.ops import acc_dtype

__all__ = ["BLOCK_K", "BLOCK_Q", "block_ranges", "blockwise_causal_attention", "key_starts", "segment_ids"]

# 128 x 128 tiles: a [B, n, 128, 128] fp32 tile is small next to q/k/v, and 128 amortises the Python loop.
BLOCK_Q = 128
BLOCK_K = 128


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment id ``[total]`` int64 of every packed token from ``cu_seqlens [N + 1]`` (Megatron's THD layout).

    Tokens past ``cu_seqlens[-1]`` (padding) form one more segment of their own.
    """
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), pos, right=True)


def _tile_keep(seg, qpos, k0, k1):
    """``[bq, bk]`` bool: key ``k0 + j`` at or before query position ``qpos[i]``, in the same segment (``seg [Sk]``
    or None)."""
    ki = torch.arange(k0, k1, device=qpos.device)[None, :]
    keep = ki <= qpos[:, None]
    if seg is not None:
        keep = keep & (seg[qpos][:, None] == seg[None, k0:k1])
    return keep


def key_starts(seg: torch.Tensor | None, total: int, block_q: int, q_pos: torch.Tensor | None = None) -> list[int]:
    """First key each query block can see: the start of its first query's segment (0 without packing).

    ``q_pos [Sq]`` (non-decreasing key positions of the queries; default ``arange(total)``). One host sync per
    call, not one per block."""
    n_blocks = len(range(0, total if q_pos is None else q_pos.shape[0], block_q))
    if seg is None:
        return [0] * n_blocks
    firsts = seg[::block_q] if q_pos is None else seg[q_pos[::block_q]]
    return torch.searchsorted(seg, firsts.contiguous()).tolist()


def block_ranges(
    seg: torch.Tensor | None, Sq: int, Sk: int, block_q: int, q_pos: torch.Tensor | None
) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k_first, k_end)`` per query block: the keys ``[k_first, k_end)`` any of its queries can see.

    Self-attention (``q_pos`` None) ends at ``q1``; with ``q_pos`` at the block's last position + 1 (a context-
    parallel rank's queries against the gathered keys). At most two host syncs."""
    starts = key_starts(seg, Sk, block_q, q_pos)
    q0s = list(range(0, Sq, block_q))
    if q_pos is None:
        ends = [min(q0 + block_q, Sq) for q0 in q0s]
    else:
        last = torch.tensor([min(q0 + block_q, Sq) - 1 for q0 in q0s], device=q_pos.device, dtype=torch.int64)
        ends = (q_pos[last] + 1).tolist() if q0s else []
    return [(q0, min(q0 + block_q, Sq), s, e) for q0, s, e in zip(q0s, starts, ends)]


class _BlockwiseCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, seg, q_pos, block_q, block_k):
        # q: [B, n, Sq, dqk]; k: [B, n, Sk, dqk]; v: [B, n, Sk, dv]; q_pos: [Sq] key positions of the queries
        a = acc_dtype(q.dtype)
        B, n, Sq, _ = q.shape
        Sk = k.shape[2]
        out = torch.empty(B, n, Sq, v.shape[-1], device=q.device, dtype=a)
        lse = torch.empty(B, n, Sq, device=q.device, dtype=a)
        pos = torch.arange(Sq, device=q.device) if q_pos is None else q_pos
        for q0, q1, k_first, k_end in block_ranges(seg, Sq, Sk, block_q, q_pos):
            qb = q[:, :, q0:q1].to(a) * scale
            m = torch.full((B, n, q1 - q0), float("-inf"), device=q.device, dtype=a)
            l_sum = torch.zeros_like(m)
            acc = torch.zeros(B, n, q1 - q0, v.shape[-1], device=q.device, dtype=a)
            ks = k_first // block_k * block_k
            for k0 in range(ks, k_end, block_k):
                k1 = min(k0 + block_k, Sk)
                s = qb @ k[:, :, k0:k1].to(a).transpose(-1, -2)  # [B, n, bq, bk]
                s = s.masked_fill(~_tile_keep(seg, pos[q0:q1], k0, k1), float("-inf"))
                # rows with no visible key yet (a tile before their segment starts) keep m = -inf:
                # shift by 0 there so exp gives 0, not exp(-inf + inf) = nan
                m_new = torch.maximum(m, s.amax(-1))
                shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
                p = torch.exp(s - shift[..., None])
                corr = torch.exp(m - shift)
                l_sum = l_sum * corr + p.sum(-1)
                acc = acc * corr[..., None] + p @ v[:, :, k0:k1].to(a)
                m = m_new
            out[:, :, q0:q1] = acc / l_sum[..., None]
            lse[:, :, q0:q1] = m + torch.log(l_sum)
        ctx.save_for_backward(q, k, v, out, lse, seg, q_pos)
        ctx.scale, ctx.block_q, ctx.block_k = scale, block_q, block_k
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seg, q_pos = ctx.saved_tensors
        scale, block_q, block_k = ctx.scale, ctx.block_q, ctx.block_k
        a = out.dtype
        Sq, Sk = q.shape[2], k.shape[2]
        pos = torch.arange(Sq, device=q.device) if q_pos is None else q_pos
        do = dout.to(a)
        delta = (do * out).sum(-1)  # [B, n, Sq]
        dq = torch.zeros_like(q, dtype=a)
        dk = torch.zeros_like(k, dtype=a)
        dv = torch.zeros_like(v, dtype=a)
        for q0, q1, k_first, k_end in block_ranges(seg, Sq, Sk, block_q, q_pos):
            qb = q[:, :, q0:q1].to(a)
            dob = do[:, :, q0:q1]
            ks = k_first // block_k * block_k
            for k0 in range(ks, k_end, block_k):
                k1 = min(k0 + block_k, Sk)
                kb, vb = k[:, :, k0:k1].to(a), v[:, :, k0:k1].to(a)
                s = (qb @ kb.transpose(-1, -2)) * scale
                s = s.masked_fill(~_tile_keep(seg, pos[q0:q1], k0, k1), float("-inf"))
                p = torch.exp(s - lse[:, :, q0:q1, None])  # [B, n, bq, bk]
                dv[:, :, k0:k1] += p.transpose(-1, -2) @ dob
                dp = dob @ vb.transpose(-1, -2)
                ds = p * (dp - delta[:, :, q0:q1, None]) * scale
                dq[:, :, q0:q1] += ds @ kb
                dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qb
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def blockwise_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    seg: torch.Tensor | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, n, Sq, dv]`` of ``q [B, n, Sq, dqk]`` over ``k [B, n, Sk, dqk]``, ``v [B, n, Sk, dv]``
    (any float dtype).

    :param scale: softmax scale applied to ``q . k``.
    :param seg: optional ``[Sk]`` int64 non-decreasing segment ids of the keys (packed sequences,
        :func:`segment_ids`): a query sees only keys of its own segment.
    :param q_pos: optional ``[Sq]`` int64 non-decreasing positions of the queries among the keys (a context-
        parallel rank's load-balanced queries against the gathered sequence, :mod:`kimi_core.attention.cp_layout`):
        query ``i`` sees keys ``j <= q_pos[i]`` of segment ``seg[q_pos[i]]``. Default: self-attention, ``Sq == Sk``.
    Differentiable in ``q``, ``k``, ``v`` (blockwise recomputing backward).
    """
    if k.shape[2] != v.shape[2] or (q_pos is None and q.shape[2] != k.shape[2]):
        raise ValueError(
            f"blockwise_causal_attention: self-attention needs equal lengths, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q_pos is not None and q_pos.shape != (q.shape[2],):
        raise ValueError(f"blockwise_causal_attention: q_pos {tuple(q_pos.shape)} does not match q {tuple(q.shape)}")
    return _BlockwiseCausal.apply(q, k, v, scale, seg, q_pos, block_q, block_k)
