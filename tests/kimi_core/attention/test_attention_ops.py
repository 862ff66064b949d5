"""kimi_core.attention's blockwise / sparse / top-k ops against dense float64 recomputations and kimi_core.reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import assert_close

from kimi_core.attention import (
    blockwise_causal_attention,
    blockwise_index_topk,
    causal_attention,
    segment_ids,
    sparse_topk_attention,
)
from kimi_core.reference.indexer import index_scores, topk_mask


def _dense64(q, k, v, scale, keep):
    """Dense float64 ``softmax(scale q k^T | keep) v``; q/k/v ``[B, n, S, d]``, keep ``[B or 1, 1 or n, S, S]``."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()


def _qkv(B, n, S, dqk, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, d, generator=g).to(dtype).requires_grad_() for d in (dqk, dqk, dv)]


def _grads(out, ts, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.device)
    return torch.autograd.grad((out.double() * dout).sum(), ts)


def _causal(S, seg=None):
    i = torch.arange(S)
    keep = i[None, :] <= i[:, None]
    if seg is not None:
        keep = keep & (seg[:, None] == seg[None, :])
    return keep


@pytest.mark.parametrize("S", [1, 37, 130])
def test_blockwise_matches_float64_forward_backward(S):
    """K2.x shapes (qk 192 -> 24 here, v 16): fp32 blockwise output and q/k/v gradients vs a dense float64
    recomputation, S not a multiple of the 16-wide blocks."""
    q, k, v = _qkv(2, 3, S, 24, 16)
    scale = 24**-0.5 * 1.3
    got = blockwise_causal_attention(q, k, v, scale, block_q=16, block_k=16)
    ref = _dense64(q, k, v, scale, _causal(S))
    assert_close("blockwise out", ref, got, 1e-6)
    for name, r, g in zip("qkv", _grads(ref, (q, k, v)), _grads(got, (q, k, v))):
        assert_close(f"d{name}", r, g, 1e-5)


def test_blockwise_packed_segments_match_each_sequence_alone():
    """Three packed sequences (lengths 5, 23, 13) through one call equal each sequence attended alone (float64)."""
    lens = [5, 23, 13]
    cu = torch.tensor([0, 5, 28, 41])
    q, k, v = _qkv(1, 2, 41, 8, 6, dtype=torch.float64)
    got = blockwise_causal_attention(q, k, v, 0.3, segment_ids(cu, 41), block_q=8, block_k=8)
    alone = [
        _dense64(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], 0.3, _causal(e - s)) for s, e in zip([0, 5, 28], [5, 28, 41])
    ]
    assert_close("packed", torch.cat(alone, 2), got, 1e-12)
    assert sum(lens) == 41
    gq = _grads(got, (q,))[0]
    rq = _grads(torch.cat(alone, 2), (q,))[0]
    assert_close("packed dq", rq, gq, 1e-12)
    # the dispatcher (CPU: blockwise) agrees
    assert_close("causal_attention packed", got, causal_attention(q, k, v, 0.3, cu), 1e-12)


def test_blockwise_bf16_within_bf16_error():
    """bf16 inputs: the blockwise output is within bf16's own error of the float64 answer."""
    q, k, v = _qkv(1, 2, 70, 16, 8, dtype=torch.bfloat16)
    got = blockwise_causal_attention(q, k, v, 0.25, block_q=32, block_k=32)
    assert got.dtype == torch.bfloat16
    assert_close("bf16 blockwise", _dense64(q, k, v, 0.25, _causal(70)), got, 1e-2)


@pytest.mark.parametrize(("T", "topk"), [(45, 7), (20, 64)])
def test_index_topk_matches_dense_topk_mask(T, topk):
    """The blockwise running top-k selects keys with the same scores as the reference's dense topk_mask
    (compared as sorted score lists: ReLU makes exact ties at 0 where either pick is right)."""
    g = torch.Generator().manual_seed(3)
    B, nh, d = 2, 4, 8
    q, k, w = (
        torch.randn(B, T, nh, d, generator=g),
        torch.randn(B, T, d, generator=g),
        torch.randn(B, T, nh, generator=g),
    )
    idx = blockwise_index_topk(q, k, w, topk, block_q=8, block_k=16)
    assert idx.shape == (B, T, min(topk, T))
    scores = index_scores(q, k, w)
    ref = topk_mask(scores, _causal(T), topk)
    for b in range(B):
        for t in range(T):
            sel = idx[b, t][idx[b, t] >= 0]
            assert (sel <= t).all() and len(set(sel.tolist())) == len(sel)
            got_s = scores[b, t, sel].sort().values
            ref_s = scores[b, t, ref[b, t]].sort().values
            assert torch.equal(got_s, ref_s), (b, t)


def test_index_topk_packed_stays_in_sequence():
    """Packed: each query's keys come from its own sequence, and equal the top-k of that sequence run alone."""
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 11, 30])
    q, k, w = (
        torch.randn(1, 30, 2, 8, generator=g),
        torch.randn(1, 30, 8, generator=g),
        torch.randn(1, 30, 2, generator=g),
    )
    idx = blockwise_index_topk(q, k, w, 5, segment_ids(cu, 30), block_q=4, block_k=8)
    for s, e in ((0, 11), (11, 30)):
        scores = index_scores(q[:, s:e], k[:, s:e], w[:, s:e])[0]
        ref = topk_mask(scores[None], _causal(e - s), 5)[0]
        for t in range(e - s):
            sel = idx[0, s + t][idx[0, s + t] >= 0] - s
            assert ((sel >= 0) & (sel <= t)).all(), (s, t, sel)
            assert torch.allclose(scores[t, sel].sort().values, scores[t, ref[t]].sort().values, rtol=1e-6, atol=0)


def test_sparse_topk_matches_dense_masked_forward_backward():
    """Gather attention over top-k indices equals dense float64 attention under the same keys as a mask:
    output and q/k/v gradients (fp32, S=37, k=6 with empty slots in the first rows)."""
    g = torch.Generator().manual_seed(5)
    B, n, S, topk = 2, 3, 37, 6
    q, k, v = _qkv(B, n, S, 12, 10)
    iq, ik, iw = (
        torch.randn(B, S, 2, 4, generator=g),
        torch.randn(B, S, 4, generator=g),
        torch.randn(B, S, 2, generator=g),
    )
    idx = blockwise_index_topk(iq, ik, iw, topk)
    # the dense mask of the same selection (the selection itself is checked against topk_mask above;
    # ReLU ties at 0 make two correct selections differ)
    keep = torch.zeros(B, S, S + 1, dtype=torch.bool).scatter_(-1, idx.where(idx >= 0, S), True)[..., :S, None]
    keep = keep.squeeze(-1)[:, None]  # [B, 1, S, S]
    ref = _dense64(q, k, v, 0.4, keep)
    tr = lambda t: t.transpose(1, 2)
    got = tr(sparse_topk_attention(tr(q), tr(k), tr(v), idx, 0.4))
    assert_close("sparse out", ref, got, 1e-6)
    for name, r, gr in zip("qkv", _grads(ref, (q, k, v)), _grads(got, (q, k, v))):
        assert_close(f"sparse d{name}", r, gr, 1e-5)


class _LargestAlloc(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_grows_with_s_squared(monkeypatch):
    """S=2048, 2 heads: no tensor of the forward or the backward has S*S/8 elements (dense logits would be 2*S*S).

    The indexer's query block and the sparse op's gather budget is lowered so its query blocks are smaller than S here, as they are at real
    widths (64 heads x 192 dims x 2048 keys)."""
    from kimi_core.attention import sparse_topk

    monkeypatch.setattr(sparse_topk, "GATHER_ELEMENTS", 1 << 18)
    S = 2048
    q, k, v = _qkv(1, 2, S, 16, 8)
    with _LargestAlloc() as mode:
        out = blockwise_causal_attention(q, k, v, 0.25)
        out.sum().backward()
    assert mode.largest < S * S // 8, f"largest tensor {mode.largest} elements"
    g = torch.Generator().manual_seed(0)
    iq, ik, iw = (
        torch.randn(1, S, 2, 8, generator=g),
        torch.randn(1, S, 8, generator=g),
        torch.randn(1, S, 2, generator=g),
    )
    with _LargestAlloc() as mode:
        idx = blockwise_index_topk(iq, ik, iw, 64, block_q=64)
        sparse_topk_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx, 0.25).sum().backward()
    assert mode.largest < S * S // 8, f"sparse/top-k largest tensor {mode.largest} elements"


@pytest.mark.gpu
def test_fused_sdpa_matches_blockwise_on_cuda(monkeypatch):
    """CUDA: the fused SDPA path (qk 192, v 128, packed and not) equals the blockwise kernel, bf16 bars."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(1, 4, 300, 192, 128, dtype=torch.bfloat16))
    cu = torch.tensor([0, 100, 300], device="cuda")
    for c in (None, cu):
        fused = causal_attention(q, k, v, 192**-0.5, c)
        monkeypatch.setenv("KIMI_ATTENTION", "blockwise")
        block = causal_attention(q, k, v, 192**-0.5, c)
        monkeypatch.delenv("KIMI_ATTENTION")
        assert_close("fused vs blockwise", block.float(), fused.float(), 1e-2)


@pytest.mark.gpu
def test_sparse_sdpa_matches_gather_on_cuda(monkeypatch):
    """CUDA: the fused sparse path (SDPA per query block, mask scattered from the top-k indices, checkpointed)
    equals the gather kernel, output and q/k/v gradients, S spanning several SDPA blocks."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kimi_core.attention import sparse_topk

    monkeypatch.setattr(sparse_topk, "SDPA_BLOCK_Q", 64)
    g = torch.Generator().manual_seed(6)
    B, n, S = 1, 4, 200
    q, k, v = (t.detach().cuda().transpose(1, 2).contiguous().requires_grad_() for t in _qkv(B, n, S, 192, 128))
    iq, ik, iw = (
        t.cuda()
        for t in (
            torch.randn(B, S, 2, 8, generator=g),
            torch.randn(B, S, 8, generator=g),
            torch.randn(B, S, 2, generator=g),
        )
    )
    idx = blockwise_index_topk(iq, ik, iw, 16)
    fused = sparse_topk_attention(q, k, v, idx, 192**-0.5)
    monkeypatch.setenv("KIMI_ATTENTION", "blockwise")
    gathered = sparse_topk_attention(q, k, v, idx, 192**-0.5)
    assert_close("sparse sdpa vs gather", gathered, fused, 1e-4)
    for name, r, gr in zip("qkv", _grads(gathered, (q, k, v)), _grads(fused, (q, k, v))):
        assert_close(f"sparse sdpa d{name}", r, gr, 1e-3)


def test_sparse_sdpa_blocks_match_gather_on_cpu(monkeypatch):
    """The CUDA sparse path's logic (query blocks, mask scattered from the indices, checkpointing) run through
    torch's CPU SDPA equals the gather kernel: output and q/k/v gradients, fp64, S spanning 4 blocks."""
    from kimi_core.attention import sparse_topk

    monkeypatch.setattr(sparse_topk, "SDPA_BLOCK_Q", 16)
    g = torch.Generator().manual_seed(7)
    B, n, S = 2, 3, 57
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in _qkv(B, n, S, 12, 8, torch.float64))
    iq, ik, iw = (
        torch.randn(B, S, 2, 4, generator=g),
        torch.randn(B, S, 4, generator=g),
        torch.randn(B, S, 2, generator=g),
    )
    idx = blockwise_index_topk(iq, ik, iw, 5)
    blocks = sparse_topk._sparse_sdpa(q, k, v, idx, 0.3)
    gathered = sparse_topk_attention(q, k, v, idx, 0.3)
    assert_close("sparse sdpa blocks vs gather", gathered, blocks, 1e-12)
    for name, r, gr in zip("qkv", _grads(gathered, (q, k, v)), _grads(blocks, (q, k, v))):
        assert_close(f"sparse sdpa blocks d{name}", r, gr, 1e-12)
