"""R3 routing-replay helpers (kimi_rl_glue/miles/routing_replay.py) against kimi_core.reference.moe.route."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

from kimi_core.checkpoint.tiny import tiny_config
from kimi_core.config import KimiConfig
from kimi_core.reference.moe import route
from kimi_rl_glue.miles.routing_replay import (
    layer_replay_indices,
    moe_layer_ids,
    replay_overlap,
    replay_route,
    routed_experts_array,
)


@pytest.fixture(scope="module")
def cfg():
    return KimiConfig.from_hf(tiny_config("k25"))


def test_replaying_the_routers_own_choice_reproduces_route(cfg):
    """Replaying the experts the reference router picked gives bit-identical weights."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(17, cfg.n_routed_experts, generator=g)
    bias = torch.randn(cfg.n_routed_experts, generator=g) * 0.1
    w_ref, idx_ref = route(logits, bias, cfg)
    w, idx = replay_route(logits, idx_ref, cfg)
    assert torch.equal(idx, idx_ref) and torch.equal(w, w_ref)
    assert replay_overlap(idx_ref, idx).tolist() == [1.0] * 17


def test_replay_overrides_choice_and_keeps_gradient(cfg):
    """Replayed experts replace the router's choice; weights follow the trainer's scores and carry gradients."""
    g = torch.Generator().manual_seed(1)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    logits = torch.randn(5, E, generator=g, dtype=torch.float64, requires_grad=True)
    forced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(5)])
    w, idx = replay_route(logits, forced, cfg)
    s = logits.detach().float().sigmoid().gather(1, forced)
    ref = (s / s.sum(-1, keepdim=True) if cfg.norm_topk_prob else s) * cfg.routed_scaling_factor
    assert torch.equal(idx, forced)
    assert_close("replayed weights", ref.double(), w.double(), 1e-6)
    w.sum().backward()
    assert logits.grad.abs().sum() > 0


def test_routed_experts_layout_and_padding(cfg):
    """A flat SGLang array reshapes to [tokens-1, layers, topk]; all -1 rows become arange; bad ids are named."""
    L, k, T = cfg.num_hidden_layers, cfg.num_experts_per_tok, 6
    flat = torch.arange((T - 1) * L * k) % cfg.n_routed_experts
    arr = routed_experts_array(flat.numpy().astype("int32"), T, L, k)
    assert arr.shape == (T - 1, L, k) and arr.dtype == torch.int64
    arr[2] = -1
    layer = moe_layer_ids(cfg)[0]
    idx = layer_replay_indices(arr, layer, cfg.n_routed_experts)
    assert idx[2].tolist() == list(range(k))
    with pytest.raises(ValueError, match="rollout_routed_experts"):
        routed_experts_array(flat[:-1].numpy(), T, L, k)
    arr[0, layer, 0] = cfg.n_routed_experts
    with pytest.raises(ValueError, match="expert ids outside"):
        layer_replay_indices(arr, layer, cfg.n_routed_experts)
    assert all(cfg.is_moe_layer(x) for x in moe_layer_ids(cfg))


def test_reference_model_replays_its_recorded_routing(tiny_ckpt):
    """``forward(ids, routed_experts=model.last_routed_experts())`` reproduces the logits exactly (the
    engines' ``[B, T, layers, k]`` layout round-trips), and a wrong shape is named."""
    from kimi_core.reference import load_reference_model

    model = load_reference_model(tiny_ckpt("k2", layers=3))
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="forward"):
        model.last_routed_experts()
    want = model(ids)
    routed = model.last_routed_experts()
    assert routed.shape == (2, 7, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    assert torch.equal(model(ids, routed_experts=routed), want)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        model(ids, routed_experts=routed[:, :3])
