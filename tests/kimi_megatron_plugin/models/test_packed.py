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
    model = _model(tiny_ckpt(family, layers=4))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.kimi_config.vocab_size, (1, n), generator=g) for n in LENS]
    packed = _packed_params()
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


def _packed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENS), max_seqlen_kv=max(LENS)
    )


def test_packed_routing_replay_equals_each_sequence_alone(tiny_ckpt, mcore_world):
    """R3 replay on a packed K3.1 batch (``routed_experts [1, T_total, L, k]``) equals each sequence replayed alone."""
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider
    from kimi_megatron_plugin.routing_replay import replay_routing

    path = tiny_ckpt("k31", layers=4)
    model = provider.build_model_from_hf(path, perform_initialization=False, moe_enable_routing_replay=True)
    checkpoint.load_hf_checkpoint(model, path)
    cfg = model.kimi_config
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in LENS]
    total = sum(LENS)
    routed = torch.rand(1, total, cfg.num_hidden_layers, cfg.n_routed_experts, generator=g).argsort(-1)
    routed = routed[..., : cfg.num_experts_per_tok].to(torch.int32)
    bounds = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    with torch.no_grad():
        with replay_routing(model, routed):
            got = _run(model, torch.cat(seqs, dim=1), _packed_params())
        alone = []
        for s, e, ids in zip(bounds, bounds[1:], seqs):
            with replay_routing(model, routed[:, s:e]):
                alone.append(_run(model, ids))
        with replay_routing(model, routed[:, : LENS[0]]):
            own = _run(model, seqs[0])
    assert_close("k31 packed replayed logits", torch.cat(alone, dim=1), got, 1e-5)
    assert not torch.allclose(own, _run(model, seqs[0]).detach()), "the replayed experts should change the logits"


@pytest.mark.gpu
def test_fla_varlen_kda_equals_reference_per_sequence():
    """The contract packed KimiKDA relies on under CUDA: fla's ``chunk_kda(..., cu_seqlens=)`` over three packed
    sequences equals kimi_core's torch ``chunk_kda`` run on each alone (fp32 inputs, bf16-level bar)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fla.ops.kda import chunk_kda

    from kimi_core.reference import kda as ref_kda
    from kimi_core.reference.ops import l2norm

    g = torch.Generator().manual_seed(0)
    T, H, D = sum(LENS) * 8, 2, 32
    q, k = (l2norm(torch.randn(1, T, H, D, generator=g)) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=g)
    gate = -torch.rand(1, T, H, D, generator=g) * 0.5
    beta = torch.rand(1, T, H, generator=g)
    bounds = [0, *(torch.tensor(LENS) * 8).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.long, device="cuda")
    got = chunk_kda(
        *(t.cuda() for t in (q, k, v, gate, beta)), initial_state=None, output_final_state=False, cu_seqlens=cu
    )[0]
    ref = torch.cat(
        [
            ref_kda.chunk_kda(
                *(t[:, s:e] for t in (q, k, v, gate, beta)), initial_state=None, output_final_state=False
            )[0]
            for s, e in zip(bounds, bounds[1:])
        ],
        dim=1,
    )
    assert_close("fla varlen kda", ref, got.float().cpu(), 1e-2)
