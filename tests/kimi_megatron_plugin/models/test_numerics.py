"""Tiny K2.x / K3 / K3.1 Megatron models reproduce kimi_core.reference logits on the INT4 / MXFP4 checkpoints."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

B, T = 2, 13


def _ids(vocab):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0))


def _megatron(path, **kw):
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider

    model = provider.build_model_from_hf(path, perform_initialization=False, **kw)
    checkpoint.load_hf_checkpoint(model, path)
    return model


def _logits(model, ids):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return model(ids, pos, attention_mask=None)


@pytest.mark.parametrize("family", ["k2", "k3", "k31"])
def test_logits_match_reference(family, tiny_ckpt, mcore_world):
    """fp32 Megatron logits with W4A16 experts equal the reference oracle's to <= 1e-4 relative RMS."""
    from kimi_core.reference import load_reference_model

    path = tiny_ckpt(family, layers=4)
    model = _megatron(path)
    ids = _ids(model.kimi_config.vocab_size)
    with torch.no_grad():
        got = _logits(model, ids)
    ref = load_reference_model(path)(ids)
    assert_close(f"{family} logits", ref, got, 1e-4)


def test_qat_experts_match_w4a16_and_train(tiny_ckpt, mcore_world):
    """K2.x QAT experts (Kimi grid 7.0 / -7) stay close to the W4A16 logits and get gradients.

    Not bit-equal: re-quantizing the served bf16 grid moves some groups' scale by one bf16 step
    (``bf16(q * s)`` rounds, so ``amax / 7`` need not give back ``s``); measured 8.6e-4 here.
    """
    path = tiny_ckpt("k2", layers=2)
    w4 = _megatron(path)
    qat = _megatron(path, expert_mode="qat", scale_divisor=7.0, q_min=-7)
    ids = _ids(w4.kimi_config.vocab_size)
    with torch.no_grad():
        ref = _logits(w4, ids)
    got = _logits(qat, ids)
    assert_close("qat vs w4a16 logits", ref, got, 5e-3)
    got.float().pow(2).mean().backward()
    experts = qat.decoder.layers[1].mlp.experts
    assert experts.gate_weight.grad is not None and experts.gate_weight.grad.abs().sum() > 0
    assert not any(n.endswith("_packed") for n, _ in qat.named_parameters())


def test_w4a16_experts_are_frozen_buffers(tiny_ckpt, mcore_world):
    """W4A16 experts hold only the checkpoint's packed bytes, as non-trainable buffers; the base stays nn.Parameters."""
    model = _megatron(tiny_ckpt("k3", layers=2))
    experts = model.decoder.layers[1].mlp.experts
    assert experts.gate_packed.dtype == torch.uint8 and experts.gate_scale.dtype == torch.uint8
    assert not any(".mlp.experts." in n for n, _ in model.named_parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_dense_bf16_experts_match_float64(tiny_ckpt, mcore_world):
    """Dense experts with bf16 weights and activations (one ``torch._grouped_mm`` per projection, the W4A16
    slice's BF16 baseline) against a float64 recomputation per expert of down(glu(gate x, up x)) * prob: the
    output and the gradients of the tokens and of the three weights, on ragged splits with an empty expert."""
    from kimi_core.config import load_config
    from kimi_core.kernels.bf16_grouped import uses_grouped_mm
    from kimi_core.reference.ops import glu
    from kimi_megatron_plugin.models import provider
    from kimi_megatron_plugin.models.experts import KimiExperts

    kimi = load_config(tiny_ckpt("k2", layers=2))
    cfg = provider.transformer_config(kimi, params_dtype=torch.bfloat16, num_layers=2)
    E = kimi.n_routed_experts
    ex = KimiExperts(E, cfg, kimi=kimi, mode="dense")
    assert uses_grouped_mm(torch.zeros(1, 8, dtype=torch.bfloat16), ex.gate_weight), "the grouped path is not tested"
    g = torch.Generator().manual_seed(0)
    splits = [(3 * e) % 7 for e in range(E)]
    splits[1] = 0
    x = torch.randn(sum(splits), kimi.expert_in_size, generator=g).bfloat16().requires_grad_()
    probs = torch.rand(sum(splits), generator=g)
    y, _ = ex(x, torch.tensor(splits), probs)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)

    w64 = {p: getattr(ex, f"{p}_weight").detach().double().requires_grad_() for p in ("gate", "up", "down")}
    x64 = x.detach().double().requires_grad_()
    outs = []
    for e, xe in enumerate(x64.split(splits)):
        h = glu(kimi, xe @ w64["gate"][e].T, xe @ w64["up"][e].T)
        outs.append(h @ w64["down"][e].T)
    want = torch.cat(outs) * probs.double()[:, None]
    want.backward(dy.double())
    pairs = [("y", y, want), ("dx", x.grad, x64.grad)] + [
        (f"d{p}", getattr(ex, f"{p}_weight").grad, w64[p].grad) for p in ("gate", "up", "down")
    ]
    for name, got, ref in pairs:
        assert_close(f"dense bf16 experts {name}", ref.detach(), got.double(), 2e-2)
