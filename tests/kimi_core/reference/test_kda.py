"""KDA oracle: kernels vs fla's naive recurrence, chunked vs recurrent, gates, conv state, layer vs transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
from utils import assert_close

from kimi_core.config import LinearAttnConfig
from kimi_core.reference.kda import (
    KDALayer,
    causal_conv,
    chunk_kda,
    kda_gate,
    lower_bound_gate,
    recurrent_kda,
    softplus_gate,
    unpad_a_log,
)
from kimi_core.reference.ops import l2norm
from kimi_core.reference.weights import StateDictSource, Weights

warnings.filterwarnings("ignore", message=".*[Tt]riton.*")


def _inputs(B, T, H, K, V, gate, seed=0, with_h0=True):
    g_ = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g_)
    q, k, v = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K)), r(B, T, H, V)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=g_))
    dt = 0.1 * r(H * K)
    g = kda_gate(r(B, T, H, K), A_log, dt, -5.0 if gate == "lower_bound" else None)
    beta = torch.rand(B, T, H, generator=g_)
    h0 = r(B, H, K, V) if with_h0 else None
    return q, k, v, g, beta, h0


SHAPES = [
    pytest.param(1, 63, 2, 16, 16, id="B1-T63-H2-K16-V16"),
    pytest.param(2, 100, 3, 32, 20, id="B2-T100-H3-K32-V20"),
    pytest.param(1, 130, 4, 24, 24, id="B1-T130-H4-K24-V24"),
]
GATES = [pytest.param("softplus", id="softplus-gate"), pytest.param("lower_bound", id="lower-bound-gate")]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_recurrent_matches_fla_naive(B, T, H, K, V, gate):
    """recurrent_kda equals fla.ops.kda.naive.naive_recurrent_kda (output and final state) to 1e-5 for both gates."""
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, gate)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("final_state", s_ref, s, 1e-5)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_chunk_matches_recurrent(B, T, H, K, V, gate):
    """chunk_kda (chunk 64, T not a multiple of 64) equals recurrent_kda to 1e-5, with and without a start state."""
    for with_h0 in (False, True):
        q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, gate, seed=1, with_h0=with_h0)
        o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert_close(f"o(h0={with_h0})", o_ref, o, 1e-5)
        assert_close(f"state(h0={with_h0})", s_ref, s, 1e-5)


def test_chunk_matches_recurrent_float64():
    """In float64 the chunked form equals the step loop to 1e-12: the chunk algebra is exact."""
    q, k, v, g, beta, h0 = (t.double() for t in _inputs(1, 70, 2, 8, 8, "lower_bound", seed=2))
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert_close("o64", o_ref, o, 1e-12)
    assert_close("state64", s_ref, s, 1e-12)


def test_split_sequence_equals_whole():
    """Running two halves with the carried state equals one pass (the decode contract of the kernels)."""
    q, k, v, g, beta, _ = _inputs(2, 90, 2, 16, 16, "lower_bound", seed=3, with_h0=False)
    o_all, s_all = chunk_kda(q, k, v, g, beta, output_final_state=True)
    cut = 37
    o1, s1 = chunk_kda(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], output_final_state=True)
    o2, s2 = recurrent_kda(
        q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=s1, output_final_state=True
    )
    assert_close("o", o_all, torch.cat([o1, o2], 1), 1e-5)
    assert_close("state", s_all, s2, 1e-5)


@pytest.mark.parametrize("gate", GATES)
def test_gates_match_fla(gate):
    """Both decay gates equal fla's torch references naive_kda_gate / naive_kda_lowerbound_gate."""
    fla_gate = pytest.importorskip("fla.ops.kda.gate")
    H, K = 3, 8
    f, A_log, dt = torch.randn(2, 5, H, K), torch.rand(H) * 2, torch.randn(H * K)
    if gate == "softplus":
        ref = fla_gate.naive_kda_gate(f, A_log, dt)
        got = softplus_gate(f, A_log, dt)
    else:
        ref = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt, lower_bound=-5.0)
        got = lower_bound_gate(f, A_log, dt, -5.0)
        assert got.min() >= -5.0 and got.max() <= 0  # fp32 sigmoid saturates at the bounds
    assert_close(f"{gate} gate", ref, got, 1e-6)


def test_conv_state_split():
    """causal_conv over a sequence equals causal_conv over two pieces with the carried W-1 input state."""
    x, w = torch.randn(2, 11, 6), torch.randn(6, 1, 4)
    y_all, _ = causal_conv(x, w, None)
    y1, st = causal_conv(x[:, :4], w, None)
    y2, _ = causal_conv(x[:, 4:], w, st)
    assert_close("conv", y_all, torch.cat([y1, y2], 1), 1e-6)
    manual = torch.nn.functional.silu(
        sum(w[None, None, :, 0, j] * torch.nn.functional.pad(x, (0, 0, 3, 0))[:, j : j + 11] for j in range(4))
    )
    assert_close("conv vs formula", manual, y_all, 1e-6)


def test_a_log_padding():
    """A_log padded to head_dim keeps the first num_heads entries; non-zero padding is an error naming the tensor."""
    a = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0])
    assert torch.equal(unpad_a_log(a, 3), a[:3])
    assert torch.equal(unpad_a_log(a.view(1, 1, 5, 1), 3), a[:3])
    with pytest.raises(ValueError, match="x.A_log.*padding"):
        unpad_a_log(torch.tensor([1.0, 2.0, 3.0, 0.5]), 3, "x.A_log")


def _kda_weights(hidden, H, D, W, full_rank, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    r = lambda *s, std=1.0: torch.randn(*s, generator=g_) * std
    P, p = H * D, "l.self_attn"
    sd = {f"{p}.{n}_proj.weight": r(P, hidden, std=hidden**-0.5) for n in "qkv"}
    sd.update({f"{p}.{n}_conv1d.weight": r(P, 1, W, std=0.5) for n in "qkv"})
    sd[f"{p}.f_a_proj.weight"] = r(D, hidden, std=hidden**-0.5)
    sd[f"{p}.f_b_proj.weight"] = r(P, D, std=D**-0.5)
    sd[f"{p}.b_proj.weight"] = r(H, hidden, std=hidden**-0.5)
    if full_rank:
        sd[f"{p}.g_proj.weight"] = r(P, hidden, std=hidden**-0.5)
    else:
        sd[f"{p}.g_a_proj.weight"] = r(D, hidden, std=hidden**-0.5)
        sd[f"{p}.g_b_proj.weight"] = r(P, D, std=D**-0.5)
    sd[f"{p}.A_log"] = torch.cat([torch.log(1 + 15 * torch.rand(H, generator=g_)), torch.zeros(max(D - H, 0))])
    sd[f"{p}.dt_bias"] = r(P, std=0.5)
    sd[f"{p}.o_norm.weight"] = 1 + r(D, std=0.1)
    sd[f"{p}.o_proj.weight"] = r(hidden, P, std=P**-0.5)
    return sd


class _Cfg:
    def __init__(self, H, D, W, lb, full_rank, eps=1e-5):
        self.linear_attn = LinearAttnConfig(
            kda_layers=(1,),
            full_attn_layers=(),
            num_heads=H,
            head_dim=D,
            short_conv_kernel_size=W,
            gate_lower_bound=lb,
            use_full_rank_gate=full_rank,
        )
        self.rms_norm_eps = eps


def test_kda_layer_matches_transformers_kimi_linear(monkeypatch):
    """The softplus-gate, low-rank-output-gate KDA layer equals transformers' KimiLinearDeltaAttention to 1e-5."""
    import inspect

    tkl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    # transformers dispatches to fla's Triton kernels when fla is installed; use its own torch paths
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn"):
        monkeypatch.setattr(tkl, fn, inspect.unwrap(getattr(tkl, fn)))

    hidden, H, D, W, T = 64, 4, 16, 4, 70
    sd = _kda_weights(hidden, H, D, W, full_rank=False)
    hf_cfg = KimiLinearConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        linear_attn_config={
            "num_heads": H,
            "head_dim": D,
            "short_conv_kernel_size": W,
            "kda_layers": [1],
            "full_attn_layers": [],
        },
        hidden_act="silu",
        rms_norm_eps=1e-5,
        vocab_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    layer = tkl.KimiLinearDeltaAttention(hf_cfg, 0).eval()
    p = "l.self_attn"
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            getattr(layer, n).weight.copy_(sd[f"{p}.{n}.weight"])
        layer.conv1d.weight.copy_(torch.cat([sd[f"{p}.{n}_conv1d.weight"] for n in "qkv"]))
        layer.forget_gate.f_a_proj.weight.copy_(sd[f"{p}.f_a_proj.weight"])
        layer.forget_gate.f_b_proj.weight.copy_(sd[f"{p}.f_b_proj.weight"])
        layer.forget_gate.dt_bias.copy_(sd[f"{p}.dt_bias"])
        layer.forget_gate.A_log.copy_(sd[f"{p}.A_log"][:H].view(1, 1, H, 1))
        layer.o_norm.weight.copy_(sd[f"{p}.o_norm.weight"])
        x = torch.randn(2, T, hidden)
        ref = layer(x)
    ours = KDALayer(_Cfg(H, D, W, None, False), Weights(StateDictSource(sd)), p)
    assert_close("kda layer vs transformers", ref, ours(x), 1e-5)


@pytest.mark.parametrize(
    "lb,full_rank", [pytest.param(None, False, id="kimi-linear"), pytest.param(-5.0, True, id="k3")]
)
def test_kda_layer_decode_equals_full(lb, full_rank):
    """KDALayer fed token by token (conv + recurrent state in the cache) equals the chunked full pass."""
    hidden, H, D, W, T = 48, 3, 16, 4, 20
    sd = _kda_weights(hidden, H, D, W, full_rank, seed=4)
    layer = KDALayer(_Cfg(H, D, W, lb, full_rank), Weights(StateDictSource(sd)), "l.self_attn")
    x = torch.randn(2, T, hidden)
    full = layer(x)
    cache: dict = {}
    steps = [layer(x[:, :7], cache)] + [layer(x[:, t : t + 1], cache) for t in range(7, T)]
    assert_close("decode", full, torch.cat(steps, 1), 1e-5)
