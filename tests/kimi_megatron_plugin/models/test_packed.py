"""Packed sequences (THD, ``PackedSeqParams.cu_seqlens_q``) through the tiny K2.x / K3 / K3.1 Megatron models:
a packed batch of different-length sequences equals each sequence run alone (logits and gradients, fp32)."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

LENS = (5, 13, 10)  # K3.1's tiny index_topk is 8: the longer two run the sparse top-k path


def _model(path):
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider

    model = provider.build_model_from_hf(path, perform_initialization=False)
    checkpoint.load_hf_checkpoint(model, path)
    return model


def _run(model, ids, packed=None):
    pos = torch.cat([torch.arange(n) for n in LENS])[None] if packed else torch.arange(ids.shape[1])[None]
    return model(ids, pos, attention_mask=None, packed_seq_params=packed)


@pytest.mark.parametrize("family", ["k2", "k3", "k31"])
def test_packed_batch_equals_each_sequence_alone(family, tiny_ckpt, mcore_world):
    """K2 (RoPE/YaRN MLA), K3 (KDA + gated NoPE MLA + attention-residual bank), K3.1 (+ DSA top-k): logits of
    three packed sequences equal each run alone to 1e-5 relative RMS, and so do the weight gradients of a
    summed loss."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = _model(tiny_ckpt(family, layers=4))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.kimi_config.vocab_size, (1, n), generator=g) for n in LENS]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENS), max_seqlen_kv=max(LENS)
    )
    params = [p for p in model.parameters() if p.requires_grad]

    got = _run(model, torch.cat(seqs, dim=1), packed)
    got_grads = torch.autograd.grad(got.pow(2).mean(-1).sum(), params, allow_unused=True)
    alone = [_run(model, s) for s in seqs]
    ref = torch.cat(alone, dim=1)
    ref_grads = torch.autograd.grad(ref.pow(2).mean(-1).sum(), params, allow_unused=True)

    assert_close(f"{family} packed logits", ref, got, 1e-5)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, r, gr in zip(names, ref_grads, got_grads):
        assert (r is None) == (gr is None), name
        if r is None:  # layer 0's attention-residual weights: its bank is still empty
            continue
        assert_close(f"{family} d{name}", r, gr, 1e-4)
