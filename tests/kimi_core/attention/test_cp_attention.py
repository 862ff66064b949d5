"""Context parallelism in kimi_core.attention: megatron's load-balanced layout, and a CP rank's queries (``q_pos``)
against the whole sequence's keys, equal to the rows of the full attention (dense float64 oracle)."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

from kimi_core.attention import (
    blockwise_causal_attention,
    blockwise_index_topk,
    causal_attention,
    load_balanced_positions,
    segment_ids,
)
from kimi_core.attention import causal as causal_mod
from kimi_core.reference.indexer import index_scores

CU = torch.tensor([0, 8, 28, 40])  # three packed sequences, each a multiple of 2 * cp = 4


def _dense64(q, k, v, scale, keep):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()


def _keep(S, seg=None):
    i = torch.arange(S)
    keep = i[None, :] <= i[:, None]
    if seg is not None:
        keep = keep & (seg[:, None] == seg[None, :])
    return keep


@pytest.mark.parametrize("cp", [2, 3])
def test_unpacked_positions_follow_megatron_split(cp):
    """Unpacked: the positions are megatron's ``get_batch_on_this_cp_rank`` split (view as ``2 * cp`` chunks, take
    chunks ``r`` and ``2 * cp - 1 - r``), and the ranks together cover every position once."""
    S = 12 * cp
    seen = []
    for r in range(cp):
        ref = torch.arange(S).view(2 * cp, -1).index_select(0, torch.tensor([r, 2 * cp - 1 - r])).reshape(-1)
        got = load_balanced_positions(cp, r, seq_len=S)
        assert torch.equal(got, ref)
        seen.append(got)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(S))


def test_packed_positions_split_each_sequence():
    """Packed: each sequence is split on its own (SkyRL's ``preprocess_packed_seqs``: ``half = len / cp / 2``
    tokens from ``half * r`` and from ``len - half * (r + 1)``), pieces in sequence order."""
    cp = 2
    for r in range(cp):
        ref = []
        for s, e in zip(CU.tolist(), CU[1:].tolist()):
            half = (e - s) // cp // 2
            ref += list(range(s + half * r, s + half * (r + 1)))
            ref += list(range(e - half * (r + 1), e - half * r))
        assert load_balanced_positions(cp, r, cu_seqlens=CU).tolist() == ref
    with pytest.raises(ValueError, match="multiples of 2 \\* --context-parallel-size = 4"):
        load_balanced_positions(2, 0, cu_seqlens=torch.tensor([0, 6, 12]))
    with pytest.raises(ValueError, match="not a multiple of 2"):
        load_balanced_positions(2, 0, seq_len=10)


def _qkv(B, n, S, dqk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, d, generator=g).requires_grad_() for d in (dqk, dqk, dv)]


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_cp_queries_equal_rows_of_full_attention(packed):
    """fp32, cp = 2, blocks of 8: each rank's output and ``dq`` equal the float64 full attention's rows at its
    positions, and ``dk``/``dv`` summed over the ranks equal the full ones (the gather's backward)."""
    S, cp, scale = 40, 2, 0.35
    B = 1 if packed else 2
    seg = segment_ids(CU, S) if packed else None
    q, k, v = _qkv(B, 3, S, 12, 10)
    dout = torch.randn(B, 3, S, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _dense64(q, k, v, scale, _keep(S, seg))
    rq, rk, rv = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    dk = dv = 0
    for r in range(cp):
        pos = load_balanced_positions(cp, r, **({"cu_seqlens": CU} if packed else {"seq_len": S}))
        ql = q.detach()[:, :, pos].requires_grad_()
        got = blockwise_causal_attention(ql, k, v, scale, seg, block_q=8, block_k=8, q_pos=pos)
        assert_close(f"rank {r} out", ref[:, :, pos], got, 1e-6)
        gq, gk, gv = torch.autograd.grad((got.double() * dout[:, :, pos]).sum(), (ql, k, v))
        assert_close(f"rank {r} dq", rq[:, :, pos], gq, 1e-5)
        dk, dv = dk + gk, dv + gv
    assert_close("sum of ranks' dk", rk, dk, 1e-5)
    assert_close("sum of ranks' dv", rv, dv, 1e-5)


def test_fused_runs_equal_blockwise(monkeypatch):
    """The fused path's split of a CP rank's queries into runs (SDPA, bottom-right causal, per run) equals the
    blockwise kernel: run on the CPU by forcing the fused branch (SDPA's math backend)."""
    S = 40
    q, k, v = _qkv(1, 2, S, 8, 6)
    seg = segment_ids(CU, S)
    # rank 0 holds each sequence's first and last chunk: two runs per sequence (rank 1's middle chunks touch)
    assert len(causal_mod.query_runs(load_balanced_positions(2, 0, cu_seqlens=CU), seg)) == 6
    for r in range(2):
        pos = load_balanced_positions(2, r, cu_seqlens=CU)
        ql = q.detach()[:, :, pos]
        ref = causal_attention(ql, k, v, 0.3, CU, q_pos=pos)
        with monkeypatch.context() as m:
            m.setattr(causal_mod, "uses_fused_attention", lambda q: True)
            got = causal_mod.causal_attention(ql, k, v, 0.3, CU, q_pos=pos)
        assert_close(f"rank {r} fused runs", ref, got, 1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_cp_index_topk_equals_rows_of_full_topk(packed):
    """The indexer's top-k for a CP rank's queries over the gathered keys selects, row by row, the same scores as the
    full sequence's top-k at those positions (global key positions)."""
    S, cp, topk = 40, 2, 6
    g = torch.Generator().manual_seed(3)
    B = 1 if packed else 2
    q, k, w = torch.randn(B, S, 2, 8, generator=g), torch.randn(B, S, 8, generator=g), torch.randn(B, S, 2, generator=g)
    seg = segment_ids(CU, S) if packed else None
    full = blockwise_index_topk(q, k, w, topk, seg, block_q=8, block_k=8)
    scores = index_scores(q, k, w)
    for r in range(cp):
        pos = load_balanced_positions(cp, r, **({"cu_seqlens": CU} if packed else {"seq_len": S}))
        got = blockwise_index_topk(q[:, pos], k, w[:, pos], topk, seg, block_q=8, block_k=8, q_pos=pos)
        for b in range(B):
            for i, t in enumerate(pos.tolist()):
                sel, ref = got[b, i][got[b, i] >= 0], full[b, t][full[b, t] >= 0]
                assert (sel <= t).all() and (seg is None or (seg[sel] == seg[t]).all())
                assert torch.equal(scores[b, t, sel].sort().values, scores[b, t, ref].sort().values), (r, b, t)


def test_sparse_fused_blocks_with_q_pos_equal_gather(monkeypatch):
    """K3.1 under CP: the fused path's masked SDPA blocks, each cut at its last query position, equal the gather path
    for a CP rank's queries against the whole sequence (forward and gradients; forced on the CPU, blocks of 8)."""
    from kimi_core.attention import sparse_topk

    S, cp = 40, 2
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, S, 3, d, generator=g).requires_grad_() for d in (8, 8, 6))
    iq, ik, iw = (
        torch.randn(2, S, 2, 4, generator=g),
        torch.randn(2, S, 4, generator=g),
        torch.randn(2, S, 2, generator=g),
    )
    monkeypatch.setattr(sparse_topk, "SDPA_BLOCK_Q", 8)
    for r in range(cp):
        pos = load_balanced_positions(cp, r, seq_len=S)
        idx = blockwise_index_topk(iq[:, pos], ik, iw[:, pos], 6, q_pos=pos)
        ql = q.detach()[:, pos].requires_grad_()
        ref = sparse_topk.sparse_topk_attention(ql, k, v, idx, 0.4, q_pos=pos)
        ref_g = torch.autograd.grad(ref.pow(2).sum(), (ql, k, v))
        with monkeypatch.context() as m:
            m.setattr(sparse_topk, "uses_fused_attention", lambda q: True)
            got = sparse_topk.sparse_topk_attention(ql, k, v, idx, 0.4, q_pos=pos)
        got_g = torch.autograd.grad(got.pow(2).sum(), (ql, k, v))
        assert_close(f"rank {r} sparse fused", ref, got, 1e-6)
        for name, a, b in zip("qkv", ref_g, got_g):
            assert_close(f"rank {r} sparse fused d{name}", a, b, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_cp_fused_paths_on_cuda(packed, monkeypatch):
    """CUDA, bf16, K2 head widths (qk 192, v 128): a CP = 2 rank's causal attention through SDPA runs, and its K3.1
    sparse attention through the masked SDPA blocks, equal the blockwise / gather kernels (output and gradients)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kimi_core.attention import sparse_topk, sparse_topk_attention

    monkeypatch.setattr(sparse_topk, "SDPA_BLOCK_Q", 64)
    S = 512
    cu = torch.tensor([0, 128, 384, 512], device="cuda") if packed else None
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, S, d, generator=g).cuda().bfloat16().requires_grad_() for d in (192, 192, 128))
    iq, ik, iw = (torch.randn(*s, generator=g).cuda() for s in ((1, S, 2, 8), (1, S, 8), (1, S, 2)))
    seg = segment_ids(cu, S) if packed else None
    for r in range(2):
        pos = load_balanced_positions(2, r, **({"cu_seqlens": cu} if packed else {"seq_len": S})).cuda()
        ql = q.detach()[:, :, pos].requires_grad_()
        fused = causal_attention(ql, k, v, 192**-0.5, cu, q_pos=pos)
        fg = torch.autograd.grad(fused.float().pow(2).sum(), (ql, k, v))
        with monkeypatch.context() as m:
            m.setenv("KIMI_ATTENTION", "blockwise")
            block = causal_attention(ql, k, v, 192**-0.5, cu, q_pos=pos)
        bg = torch.autograd.grad(block.float().pow(2).sum(), (ql, k, v))
        assert_close(f"rank {r} fused causal", block.float(), fused.float(), 1e-2)
        for name, a, b in zip("qkv", bg, fg):
            assert_close(f"rank {r} fused causal d{name}", a.float(), b.float(), 2e-2)
        idx = blockwise_index_topk(iq[:, pos], ik, iw[:, pos], 32, seg, q_pos=pos)
        qs, ks, vs = (t.detach().float().transpose(1, 2).contiguous().requires_grad_() for t in (ql, k, v))
        fused = sparse_topk_attention(qs, ks, vs, idx, 192**-0.5, q_pos=pos)
        with monkeypatch.context() as m:
            m.setenv("KIMI_ATTENTION", "blockwise")
            gathered = sparse_topk_attention(qs, ks, vs, idx, 192**-0.5, q_pos=pos)
        assert_close(f"rank {r} sparse sdpa vs gather", gathered, fused, 1e-4)
