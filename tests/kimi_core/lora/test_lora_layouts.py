"""Expert layouts: vLLM's stacked fold order, exact round trips, and per-token expert outputs that
every layout reproduces against a float64 brute-force loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from utils import assert_close

from kimi_core.lora import AdapterError, LoraSpec, convert_layout, load_adapter, random_adapter
from kimi_core.lora.config import module_rank_alpha, scaling_for

P = "base_model.model."


def _per_expert_ref(ad, config, moe, e, proj):
    """(A, B, scaling) of one expert read straight from per-expert tensor names, float64."""
    m = f"{moe}.experts.{e}.{proj}"
    r, alpha = module_rank_alpha(ad.adapter_config, m)
    A = ad.tensors[f"{P}{m}.lora_A.weight"].double()
    B = ad.tensors[f"{P}{m}.lora_B.weight"].double()
    assert A.shape[0] == r
    return A, B, scaling_for(ad.adapter_config, r, alpha)


@pytest.mark.parametrize("tie", [False, True], ids=["untied-gate-up-A", "tied-gate-up-A"])
def test_stacked_fold_order_matches_vllm_reading(k2_tiny, tie):
    """Reading our stacked tensors the way vLLM's _stack_moe_lora_weights does gives each expert's delta."""
    c = k2_tiny
    spec = LoraSpec(rank=4, alpha=6, normalize_moe_lora=True, target_modules=("gate_proj", "up_proj", "down_proj"))
    pe = random_adapter(c, spec, seed=1, layout="per_expert", tie_gate_up_a=tie)
    st = convert_layout(pe, c, "stacked")
    E, I = c.n_routed_experts, c.moe_intermediate_size
    moe = "model.layers.2.mlp"
    for fused, projs in (("base_layer", ("gate_proj", "up_proj")), (None, ("down_proj",))):
        stem = f"{moe}.experts" + (f".{fused}" if fused else "")
        A = st.tensors[f"{P}{stem}.lora_A.weight"].double()
        B = st.tensors[f"{P}{stem}.lora_B.weight"].double()
        r_cfg, alpha = module_rank_alpha(
            st.adapter_config, f"{moe}.experts." + ("gate_up_proj" if fused else "down_proj")
        )
        # vLLM: A.reshape(E, -1, in); B.reshape(out, -1, E).permute(2, 0, 1)
        A3 = A.reshape(E, -1, A.shape[-1])
        B3 = B.reshape(B.shape[0], -1, E).permute(2, 0, 1)
        assert A3.shape[1] == r_cfg == (2 if tie or not fused else 4)
        s = scaling_for(st.adapter_config, r_cfg, alpha)
        for e in range(E):
            got = s * B3[e] @ A3[e]
            rows = [slice(0, I), slice(I, 2 * I)] if fused else [slice(None)]
            for proj, rs in zip(projs, rows):
                Ar, Br, sr = _per_expert_ref(pe, c, moe, e, proj)
                assert_close(f"{proj}[{e}]", sr * Br @ Ar, got[rs], 1e-12)


ROUND_TRIPS = [
    ("per_expert", "per_expert", "per_expert_3d"),
    ("per_expert", "per_expert", "stacked"),
    ("per_expert", "per_expert_3d", "stacked"),
    ("shared_outer", "shared_outer", "per_expert"),
    ("shared_outer", "shared_outer", "per_expert_3d"),
    ("shared_outer", "shared_outer", "stacked"),
]


@pytest.mark.parametrize("spec_layout,start,via", ROUND_TRIPS, ids=[f"{a}:{b}->{c}" for a, b, c in ROUND_TRIPS])
@pytest.mark.parametrize("normalize", [False, True], ids=["r", "r//k"])
def test_round_trip_is_exact(tiny, spec_layout, start, via, normalize):
    """start -> via -> start reproduces every tensor bit-exactly and the same rank/alpha patterns."""
    spec = LoraSpec(rank=4, alpha=8, expert_layout=spec_layout, normalize_moe_lora=normalize)
    a = random_adapter(tiny, spec, seed=3, layout=start)
    b = convert_layout(convert_layout(a, tiny, via), tiny, start)
    assert set(a.tensors) == set(b.tensors)
    for k, v in a.tensors.items():
        assert torch.equal(v, b.tensors[k]), k
    assert a.adapter_config["rank_pattern"] == b.adapter_config["rank_pattern"]
    assert a.adapter_config["alpha_pattern"] == b.adapter_config["alpha_pattern"]


def test_per_expert_to_shared_outer_needs_shared_factors(k3_tiny):
    """Converting independent per-expert factors to shared-outer is refused (it is not exact)."""
    a = random_adapter(k3_tiny, LoraSpec(rank=2), layout="per_expert")
    with pytest.raises(AdapterError, match="shared-outer layout needs one shared A"):
        convert_layout(a, k3_tiny, "shared_outer")


def _glu(g, u):
    return F.silu(g) * u


@pytest.mark.parametrize("spec_layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("normalize", [False, True], ids=["r", "r//k"])
def test_expert_outputs_equal_bruteforce_for_every_layout(k3_tiny, spec_layout, normalize):
    """Per-token routed-expert outputs with LoRA, resolved from each layout, equal a float64 loop."""
    c = k3_tiny
    E, I, W = c.n_routed_experts, c.moe_intermediate_size, c.expert_in_size
    g_, u_, d_ = c.expert_names
    spec = LoraSpec(rank=4, alpha=3, expert_layout=spec_layout, normalize_moe_lora=normalize)
    src = random_adapter(c, spec, seed=5, layout="per_expert")
    gen = torch.Generator().manual_seed(0)
    Wg, Wu = torch.randn(E, I, W, generator=gen) / W**0.5, torch.randn(E, I, W, generator=gen) / W**0.5
    Wd = torch.randn(E, W, I, generator=gen) / I**0.5
    T, k = 7, c.num_experts_per_tok
    x = torch.randn(T, W, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=gen)
    moe = "language_model.model.layers.3.block_sparse_moe"

    ref = torch.zeros(T, W, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])

            def lin(v, Wm, proj):
                A, B, s = _per_expert_ref(src, c, moe, e, proj)
                return v @ Wm[e].double().T + s * (v @ A.T) @ B.T

            xt = x[t].double()
            h = _glu(lin(xt, Wg, g_), lin(xt, Wu, u_))
            ref[t] += wts[t, j].double() * lin(h, Wd, d_)

    layouts = ["per_expert", "per_expert_3d", "stacked"] + (["shared_outer"] if spec_layout == "shared_outer" else [])
    for lay in layouts:
        ad = load_adapter(convert_layout(src, c, lay), c)
        got = torch.zeros(T, W)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                fg, fu, fd = (ad.expert(moe, e, p) for p in (g_, u_, d_))
                h = _glu(x[t] @ Wg[e].T + fg.delta(x[t]), x[t] @ Wu[e].T + fu.delta(x[t]))
                got[t] += wts[t, j] * (h @ Wd[e].T + fd.delta(h))
        assert_close(f"moe out {lay}", ref, got, 1e-5)
