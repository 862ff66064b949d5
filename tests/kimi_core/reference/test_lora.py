"""LoRA-aware forward: a zero-B adapter is the base model; random factors equal merging into fp32 master weights."""

from __future__ import annotations

import pytest
import torch
from ref_helpers import DictAdapter, Factors, tiny
from utils import assert_close, rel_rms_error

from kimi_core.reference import KimiReferenceModel

MODELS = [pytest.param(m, id=m) for m in ("k2", "k3", "k31")]


def _targets(sd: dict, cfg):
    """(dense module names, expert (moe, e, proj) triples) of every linear in the tiny checkpoint."""
    dense, experts = [], []
    for k, v in sd.items():
        if ".experts." in k and k.endswith((".weight", ".weight_packed")):
            mod = k.rsplit(".", 1)[0]
            moe, rest = mod.split(".experts.")
            e, proj = rest.split(".")
            experts.append((moe, int(e), proj))
        elif k.endswith(".weight") and v.dim() == 2:
            mod = k[: -len(".weight")]
            last = mod.rsplit(".", 1)[-1]
            # norms, the embedding, the router and the [1, H] attention-residual projections are not LoRA targets
            if last not in ("embed_tokens", "gate") and "norm" not in last and not last.endswith("_res_proj"):
                dense.append(mod)
    return dense, experts


def _adapter(model, dense, experts, r=4, zero_b=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = model.weights

    def make(W):
        out_f, in_f = W.shape
        A = torch.randn(r, in_f, generator=g) / in_f**0.5
        B = torch.zeros(out_f, r) if zero_b else torch.randn(out_f, r, generator=g) * 0.05
        return Factors(A, B, scaling=2.0)

    d = {m: make(w.source.get_weight(m, torch.float32)) for m in dense}
    e = {t: make(w.source.get_weight(f"{t[0]}.experts.{t[1]}.{t[2]}", torch.float32)) for t in experts}
    return DictAdapter(d, e)


@pytest.mark.parametrize("model", MODELS)
def test_zero_b_adapter_equals_base(model, tiny_models):
    """An adapter on every linear and expert with B = 0 gives exactly the base logits."""
    cfg, sd, m = tiny_models(model)
    dense, experts = _targets(sd, m.config)
    ids = torch.randint(0, 1024, (2, 11))
    ad = _adapter(m, dense, experts, zero_b=True)
    assert_close(f"{model} zero-B", m(ids), m(ids, adapter=ad), 0.0)


@pytest.mark.parametrize("model", MODELS)
def test_random_adapter_equals_merged_weights(model, tiny_models):
    """Random LoRA factors on every linear and routed expert equal the model whose dequantized fp32 weights have W + s*B@A merged in."""
    cfg, sd, m = tiny_models(model)
    dense, experts = _targets(sd, m.config)
    assert dense and experts
    ad = _adapter(m, dense, experts, seed=1)
    ids = torch.randint(0, 1024, (2, 11), generator=torch.Generator().manual_seed(2))
    got = m(ids, adapter=ad)
    assert_close(f"{model} adapter vs merged", _merged_model(cfg, sd, m, ad, dense, experts)(ids), got, 1e-5)
    assert rel_rms_error(m(ids), got) > 1e-2, "the random adapter must change the logits"


def _merged_model(cfg, sd, m, ad, dense, experts):
    """A plain fp32 model whose weights are the dequantized masters plus ``scaling * B @ A`` of ``ad``."""
    merged = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".weight_shape")):
            continue
        if k.endswith(".weight_packed"):
            mod = k[: -len(".weight_packed")]
            merged[f"{mod}.weight"] = m.weights.source.get_weight(mod, torch.float32)
        else:
            merged[k] = v.float()
    for mod in dense:
        f = ad.dense(mod)
        if f is not None:
            merged[f"{mod}.weight"] = merged[f"{mod}.weight"] + f.scaling * f.B.float() @ f.A.float()
    for moe, e, proj in experts:
        f = ad.expert(moe, e, proj)
        if f is not None:
            merged[f"{moe}.experts.{e}.{proj}.weight"] += f.scaling * f.B.float() @ f.A.float()
    cfg_plain = dict(cfg)
    cfg_plain.pop("quantization_config", None)
    return KimiReferenceModel.from_state_dict(cfg_plain, merged)


@pytest.mark.parametrize(
    "model,layout",
    [
        pytest.param("k2", "per_expert", id="k2-per_expert"),
        pytest.param("k3", "shared_outer", id="k3-shared_outer"),
        pytest.param("k31", "stacked", id="k31-stacked"),
    ],
)
def test_peft_adapter_through_kimi_core_lora(model, layout, tiny_models):
    """A PEFT-format adapter (kimi_core.lora.random_adapter, any layout) passed to forward equals merging its resolved factors."""
    from kimi_core import lora
    from kimi_core.lora.config import LoraSpec
    from kimi_core.lora.random_adapter import random_adapter

    cfg, sd, m = tiny_models(model)
    spec = LoraSpec(rank=8, alpha=16.0, expert_layout="shared_outer" if layout == "shared_outer" else "per_expert")
    peft = random_adapter(m.config, spec, seed=3, layout=layout, b_std=0.05)
    resolved = lora.load_adapter(peft, m.config)
    dense, experts = _targets(sd, m.config)
    # every module of the adapter is reached under a name the reference asks for
    assert sum(resolved.dense(d) is not None for d in dense) == len(resolved.modules())
    assert {moe for moe, e, p in experts if resolved.expert(moe, e, p) is not None} == set(resolved.moe_modules())
    ids = torch.randint(0, 1024, (2, 11), generator=torch.Generator().manual_seed(4))
    got = m(ids, adapter=peft)  # resolved inside forward through kimi_core.lora.load_adapter
    assert_close(
        f"{model} {layout} adapter vs merged", _merged_model(cfg, sd, m, resolved, dense, experts)(ids), got, 1e-5
    )
    assert rel_rms_error(m(ids), got) > 1e-3, "the adapter must change the logits"


def test_adapter_gradient_matches_finite_difference():
    """Autograd of sum(logprobs) w.r.t. a LoRA B factor (K3, float64) equals a central finite difference."""
    cfg, sd = tiny("k3", quant="none", layers=4)
    m = KimiReferenceModel.from_state_dict(cfg, sd, dtype=torch.float64)
    mod = "language_model.model.layers.1.self_attn.q_proj"
    W = m.weights.weight(mod)
    g = torch.Generator().manual_seed(5)
    A = torch.randn(2, W.shape[1], generator=g, dtype=torch.float64) / W.shape[1] ** 0.5
    B = (0.05 * torch.randn(W.shape[0], 2, generator=g, dtype=torch.float64)).requires_grad_(True)
    ids = torch.randint(0, 1024, (1, 7), generator=g)

    def f(b):
        return m.logprobs(ids[:, :-1], ids[:, 1:], adapter=DictAdapter({mod: Factors(A, b, 2.0)}, {})).sum()

    f(B).backward()
    i, j, h = 3, 1, 1e-5
    E = torch.zeros_like(B)
    E[i, j] = h
    with torch.no_grad():
        fd = (f(B + E) - f(B - E)) / (2 * h)
    assert B.grad is not None and abs(B.grad[i, j].item()) > 1e-6
    assert_close("dlogp/dB", fd.reshape(1), B.grad[i, j].reshape(1), 1e-6)
