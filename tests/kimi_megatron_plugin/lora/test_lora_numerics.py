"""Plugin LoRA forward equals kimi_core.reference with the exported adapter (every layout), and its
gradients equal float64 finite differences of the reference."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close, rel_rms_error

B, T = 2, 9

# (family, training expert layout, normalize_moe_lora); tiny models: K2 2 layers (dense + MoE),
# K3/K3.1 4 layers (KDA x3 + gated NoPE MLA, latent MoE, attention-residual bank; K3.1 indexer)
CASES = [
    pytest.param("k2", "per_expert", False, id="k2-per_expert"),
    pytest.param("k2", "shared_outer", False, id="k2-shared_outer"),
    pytest.param("k2", "per_expert", True, id="k2-per_expert-normalised"),
    pytest.param("k3", "shared_outer", True, id="k3-shared_outer-normalised"),
    pytest.param("k31", "per_expert", False, id="k31-per_expert"),
]
LAYERS = {"k2": 2, "k3": 4, "k31": 4}


@pytest.fixture(scope="module")
def models(tiny_ckpt, mcore_world):
    """``models(family) -> (path, megatron fp32 model, reference fp32 model)``, built once per family."""
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider

    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_ckpt(family, layers=LAYERS[family])
            m = provider.build_model_from_hf(path, perform_initialization=False)
            checkpoint.load_hf_checkpoint(m, path)
            cache[family] = (path, m, load_reference_model(path))
        return cache[family]

    return get


def _ids(vocab, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _run(m, ids):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return m(ids, pos, attention_mask=None)


@pytest.mark.parametrize("family,layout,normalise", CASES)
def test_forward_equals_reference_every_export_layout(models, family, layout, normalise):
    """With a random adapter loaded, plugin logits equal the reference's for the adapter exported in
    every file layout the engines load (fp32, <= 1e-4 relative RMS)."""
    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_megatron_plugin.lora import apply_lora, export_adapter

    path, m, ref = models(family)
    spec = LoraSpec(rank=8, alpha=16, expert_layout=layout, normalize_moe_lora=normalise)
    lora = apply_lora(m, spec)
    try:
        lora.load_adapter(random_adapter(m.kimi_config, spec, seed=3, layout=layout))
        ids = _ids(m.kimi_config.vocab_size)
        with torch.no_grad():
            got = _run(m, ids)
        base = ref(ids)
        assert rel_rms_error(base, got) > 1e-2, "the adapter must change the logits for the test to mean anything"
        forms = ["per_expert", "per_expert_3d", "stacked"] + (["shared_outer"] if layout == "shared_outer" else [])
        for form in forms:
            ad = export_adapter(lora, layout=form, dtype=torch.float32)
            assert_close(f"{family} {layout} norm={normalise} export {form}", ref(ids, adapter=ad), got, 1e-4)
        if normalise:
            cfg = export_adapter(lora, layout="per_expert").adapter_config
            assert set(cfg["rank_pattern"].values()) == {8 // m.kimi_config.num_experts_per_tok}
    finally:
        lora.remove()


def _grads_and_oracle(models, family, layout):
    """Plugin fp32 autograd gradients of a fixed loss, the float64 factors, and a float64 reference
    loss function of those factors (fed straight in, no fp32 round trip)."""
    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_core.lora.resolve import LoraFactors
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin.lora import apply_lora, lora_decomposed

    path, m, _ = models(family)
    spec = LoraSpec(rank=4, alpha=8, expert_layout=layout)
    lora = apply_lora(m, spec)
    try:
        lora.load_adapter(random_adapter(m.kimi_config, spec, seed=5, layout=layout))
        ids = _ids(m.kimi_config.vocab_size, 1)[:1]
        w = torch.randn(1, T, m.kimi_config.vocab_size, generator=torch.Generator().manual_seed(2))
        lora.zero_grad()
        (_run(m, ids) * w).sum().backward()
        grads = lora_decomposed(lora, torch.float64, grads=True)
        facs = lora_decomposed(lora, torch.float64)
    finally:
        lora.remove()
    ref = load_reference_model(path, dtype=torch.float64)
    s_d = spec.scaling(spec.rank, spec.alpha)
    s_e = spec.scaling(spec.expert_rank(m.kimi_config.num_experts_per_tok), spec.expert_alpha_value())

    class Factors:
        def dense(self, mod):
            return LoraFactors(*facs.dense[mod], s_d) if mod in facs.dense else None

        def expert(self, moe, e, proj):
            A, Bm = facs.experts[(moe, proj)]
            return LoraFactors(A[0 if A.shape[0] == 1 else e], Bm[0 if Bm.shape[0] == 1 else e], s_e)

    def loss():
        return (ref(ids, adapter=Factors()) * w.double()).sum()

    return grads, facs, loss


def _get(dec, k):
    return dec.dense[k] if k in dec.dense else dec.experts[k]


def test_gradients_match_float64_finite_differences(models):
    """LoRA-factor gradients of the plugin (fp32 autograd, K2: MLA, dense MLP, shared + shared-outer
    routed experts) equal central finite differences of the float64 reference with the same factors."""
    grads, facs, loss = _grads_and_oracle(models, "k2", "shared_outer")
    g = torch.Generator().manual_seed(7)
    checked = 0
    for k in sorted(facs.dense)[::2] + sorted(facs.experts):
        for ab in (0, 1):
            tf = _get(facs, k)[ab].view(-1)
            flat = _get(grads, k)[ab].reshape(-1)
            idx = int(flat.abs().argmax()) if checked % 2 else int(torch.randint(0, flat.numel(), (1,), generator=g))
            eps, old = 1e-5, float(tf[idx])
            with torch.no_grad():
                tf[idx] = old + eps
                lp = float(loss())
                tf[idx] = old - eps
                lm = float(loss())
                tf[idx] = old
            fd = (lp - lm) / (2 * eps)
            scale = max(1.0, flat.abs().max().item())
            assert abs(fd - float(flat[idx])) <= 1e-4 * scale, (
                f"{k} lora_{'AB'[ab]}[{idx}]: autograd {float(flat[idx]):.6g} vs float64 finite difference {fd:.6g}"
            )
            checked += 1
    assert checked >= 12


def test_gradients_equal_float64_reference_autograd(models):
    """Every LoRA-factor gradient of the plugin on K3 (KDA, gated NoPE MLA, latent MoE, attention
    residuals, shared-outer experts) equals float64 reference autograd (fp32 vs fp64: <= 1e-4)."""
    grads, facs, loss = _grads_and_oracle(models, "k3", "shared_outer")
    leaves = [t.requires_grad_() for k in list(facs.dense) + list(facs.experts) for t in _get(facs, k)]
    loss().backward()
    n = 0
    for k in list(facs.dense) + list(facs.experts):
        for ab in (0, 1):
            assert_close(f"k3 grad {k} lora_{'AB'[ab]}", _get(facs, k)[ab].grad, _get(grads, k)[ab], 1e-4)
            n += 1
    assert n == len(leaves) and n > 40
