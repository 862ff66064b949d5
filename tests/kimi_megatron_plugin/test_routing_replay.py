"""Rollout routing replay (R3) on the Megatron models through megatron-core's ``RouterReplay`` equals
kimi_core.reference's replay (fp32, W4A16 experts), and a replay that differs from the router's own
choice changes the logits."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close, rel_rms_error

B, T = 2, 9


def _setup(path):
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider

    model = provider.build_model_from_hf(path, perform_initialization=False, moe_enable_routing_replay=True)
    checkpoint.load_hf_checkpoint(model, path)
    cfg = model.kimi_config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    # experts no router of this model would pick as a rule: a random distinct set per token and layer
    routed = torch.rand(B, T, cfg.num_hidden_layers, cfg.n_routed_experts, generator=g).argsort(-1)
    return model, load_reference_model(path), ids, routed[..., : cfg.num_experts_per_tok].to(torch.int32)


def _logits(model, ids):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return model(ids, pos, attention_mask=None)


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_replayed_routing_matches_reference(family, tiny_ckpt, mcore_world):
    from kimi_megatron_plugin.routing_replay import replay_routing

    model, ref, ids, routed = _setup(tiny_ckpt(family, layers=3))
    with torch.no_grad():
        with replay_routing(model, routed):
            got = _logits(model, ids)
        own = _logits(model, ids)  # the replay is switched off again after the block
    want = ref(ids, routed_experts=routed)
    assert_close(f"{family} replayed logits", want, got, 1e-4)
    assert_close(f"{family} logits after the replay", ref(ids), own, 1e-4)
    assert rel_rms_error(want, ref(ids)) > 1e-2, "the replayed experts should change the logits"


def test_replay_errors_name_the_problem(tiny_ckpt, mcore_world):
    from kimi_megatron_plugin.models import provider
    from kimi_megatron_plugin.routing_replay import replay_routing

    path = tiny_ckpt("k2", layers=3)
    model, _, ids, routed = _setup(path)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        with replay_routing(model, routed[:, :, :2]):
            pass
    with pytest.raises(ValueError, match="outside"):
        with replay_routing(model, routed + model.kimi_config.n_routed_experts):
            pass
    plain = provider.build_model_from_hf(path, perform_initialization=False)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        with replay_routing(plain, routed):
            pass
