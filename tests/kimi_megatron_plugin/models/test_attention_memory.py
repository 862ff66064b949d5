"""KimiCoreAttention keeps memory linear in S: no tensor of its forward or backward grows with S * S, dense
causal (K2.x / K3 MLA) and K3.1's sparse top-k alike; on CUDA its fused SDPA path equals the blockwise one."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import assert_close

S, HEADS, DQK, DV = 2500, 2, 24, 16  # S not a multiple of any block


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _core():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kimi_megatron_plugin.models.layers import KimiCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DQK, num_attention_heads=HEADS)
    return KimiCoreAttention(cfg, softmax_scale=DQK**-0.5)


def _qkv(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(S, 1, HEADS, d, generator=g).to(device=device, dtype=dtype).requires_grad_() for d in (DQK, DQK, DV)
    ]


@pytest.mark.parametrize("sparse", [False, True])
def test_core_attention_allocates_nothing_quadratic(sparse, monkeypatch, mcore_world):
    """S=2500, 2 heads: the largest tensor is under S*S/8 elements (dense fp32 logits would be 2*S*S)."""
    from kimi_core.attention import sparse_topk

    monkeypatch.setattr(sparse_topk, "GATHER_ELEMENTS", 1 << 18)  # query blocks < S, as at real widths
    core = _core()
    q, k, v = _qkv()
    idx = None
    if sparse:  # 32 causal keys per query: the latest ones (any valid selection exercises the memory)
        t = torch.arange(S)[:, None] - torch.arange(32)[None, :]
        idx = t.where(t >= 0, -1)[None]
    with _LargestTensor() as mode:
        out = core(q, k, v, None, topk_idx=idx)
        out.square().sum().backward()
    assert out.shape == (S, 1, HEADS * DV)
    assert mode.largest < S * S // 8, f"largest tensor: {mode.largest} elements"


@pytest.mark.gpu
def test_fused_core_attention_matches_blockwise_on_cuda(monkeypatch, mcore_world):
    """CUDA, bf16, qk 24 / v 16 heads: SDPA (KIMI_ATTENTION=auto) equals the blockwise kernel, packed and not."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.packed_seq_params import PackedSeqParams

    core = _core()
    q, k, v = _qkv("cuda", torch.bfloat16)
    cu = torch.tensor([0, 700, S], dtype=torch.int32, device="cuda")
    for packed in (None, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)):
        monkeypatch.setenv("KIMI_ATTENTION", "auto")
        fused = core(q, k, v, None, packed_seq_params=packed)
        monkeypatch.setenv("KIMI_ATTENTION", "blockwise")
        block = core(q, k, v, None, packed_seq_params=packed)
        assert_close("fused vs blockwise", block.float(), fused.float(), 1e-2)


def test_megatron_causal_mask_takes_the_linear_path(mcore_world):
    """megatron's own causal ``attention_mask`` (True above the diagonal) gives the maskless result and no
    extra S x S tensor; any other mask (a padded key) takes the dense path and changes the result."""
    core = _core()
    q, k, v = (t.detach()[:300] for t in _qkv())
    causal = torch.ones(300, 300, dtype=torch.bool).triu(1)[None, None]
    free = core(q, k, v, None)
    with _LargestTensor() as mode:
        masked = core(q, k, v, causal)
    assert torch.equal(free, masked)
    assert mode.largest <= 300 * 300  # the mask itself; the dense logits would be HEADS * 300 * 300
    padded = causal.clone()
    padded[..., 5] = True
    padded[..., 5, 5] = False  # key 5 hidden from every other query
    other = core(q, k, v, padded)
    assert not torch.allclose(other[6:], free[6:]) and torch.allclose(other[:5], free[:5], atol=1e-6)
