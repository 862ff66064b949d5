"""MoE oracle: noaux_tc routing vs a brute-force loop, latent MoE with SiTU vs a dense float64 formula."""

from __future__ import annotations

import pytest
import torch
from ref_helpers import tiny
from utils import assert_close

from kimi_core.config import KimiConfig
from kimi_core.reference import KimiReferenceModel
from kimi_core.reference.moe import route
from kimi_core.reference.ops import situ_glu


@pytest.mark.parametrize(
    "n_group,topk_group,norm",
    [
        pytest.param(1, 1, True, id="k2-k3-no-groups"),
        pytest.param(4, 2, True, id="groups4-keep2"),
        pytest.param(4, 1, False, id="groups4-keep1-no-renorm"),
    ],
)
def test_route_matches_brute_force(n_group, topk_group, norm):
    """route() picks the same experts with the same weights as a per-token loop of the DeepSeek noaux_tc rule."""
    cfg_d, _ = tiny("k2")
    cfg_d.update(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    cfg = KimiConfig.from_hf(cfg_d)
    torch.manual_seed(0)
    logits, bias = torch.randn(9, 16), 0.1 * torch.randn(16)
    wts, idx = route(logits, bias, cfg)
    for n in range(9):
        s = torch.sigmoid(logits[n].double())
        c = s + bias.double()
        per = 16 // n_group
        gs = [sorted(c[g * per : (g + 1) * per].tolist())[-2:] for g in range(n_group)]
        keep_groups = sorted(range(n_group), key=lambda g: -sum(gs[g]))[:topk_group]
        cand = [e for e in range(16) if e // per in keep_groups]
        pick = sorted(cand, key=lambda e: -c[e].item())[: cfg.num_experts_per_tok]
        w = s[pick] / (s[pick].sum() if norm else 1.0) * cfg.routed_scaling_factor
        order = idx[n].argsort()
        assert sorted(pick) == idx[n][order].tolist()
        ref = dict(zip(pick, w.tolist()))
        assert_close(f"weights[{n}]", torch.tensor([ref[e] for e in sorted(pick)]), wts[n][order], 1e-6)


def test_latent_moe_matches_dense_float64():
    """K3 latent MoE (MXFP4 experts dequantized per layer) equals the dense float64 formula over all experts."""
    cfg_d, sd = tiny("k3")
    model = KimiReferenceModel.from_state_dict(cfg_d, sd)
    cfg, w = model.config, model.weights
    moe = model.mlp[1]
    x = torch.randn(2, 11, cfg.hidden_size)
    got = moe(x)
    wts, idx = moe.last_routing
    p = moe.p
    W = lambda n: w.source.get_weight(n, torch.float64)
    xf = x.reshape(-1, cfg.hidden_size).double()
    z = xf @ W(f"{p}.routed_expert_down_proj").T
    dense_w = torch.zeros(xf.shape[0], cfg.n_routed_experts, dtype=torch.float64).scatter_(1, idx, wts.double())
    y = torch.zeros_like(z)
    for e in range(cfg.n_routed_experts):
        h = situ_glu(z @ W(f"{p}.experts.{e}.w1").T, z @ W(f"{p}.experts.{e}.w3").T, 4.0, 25.0)
        y += dense_w[:, e : e + 1] * (h @ W(f"{p}.experts.{e}.w2").T)
    y = y / torch.sqrt((y**2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * W(f"{p}.routed_expert_norm").double()
    out = y @ W(f"{p}.routed_expert_up_proj").T
    sh = f"{p}.shared_experts"
    out += situ_glu(xf @ W(f"{sh}.gate_proj").T, xf @ W(f"{sh}.up_proj").T) @ W(f"{sh}.down_proj").T
    assert_close("latent moe", out.view_as(got), got, 1e-5)


def test_situ_matches_formula():
    """situ_glu equals beta*tanh(a/beta)*sigmoid(a) * beta_lin*tanh(b/beta_lin) with the uncapped sigmoid input."""
    a, b = 10 * torch.randn(1000), 60 * torch.randn(1000)
    ref = (4 * torch.tanh(a.double() / 4) / (1 + torch.exp(-a.double()))) * (25 * torch.tanh(b.double() / 25))
    assert_close("situ", ref, situ_glu(a, b, 4.0, 25.0), 1e-6)
