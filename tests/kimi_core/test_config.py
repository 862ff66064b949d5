"""kimi_core.config: the real published configs parse, and bad configs name the offending field."""

from __future__ import annotations

import copy

import pytest

from kimi_core.checkpoint.tiny import tiny_config
from kimi_core.config import ConfigError, KimiConfig
from kimi_core.release_configs import k3_release_config


def test_k3_release_schedule():
    """The K3 release has 69 KDA + 24 MLA layers, layer 0 KDA+dense, MLA at 3,7,...,91,92 and 8 snapshots."""
    c = KimiConfig.from_hf(k3_release_config())
    kda = [i for i in range(93) if c.is_kda_layer(i)]
    mla = [i for i in range(93) if not c.is_kda_layer(i)]
    assert len(kda) == 69 and len(mla) == 24
    assert mla == list(range(3, 92, 4)) + [92]
    assert c.is_kda_layer(0) and not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert c.num_attn_res_snapshots() == 8
    assert c.n_routed_experts == 896 and c.num_experts_per_tok == 16 and c.n_shared_experts == 2
    assert c.expert_in_size == 3584 and c.quant.format == "mxfp4-pack-quantized"


@pytest.mark.parametrize("model", ["k2", "k25", "k3", "k31"])
def test_tiny_configs_parse(model):
    """Every tiny config parses to its family, with the release's expert format."""
    c = KimiConfig.from_hf(tiny_config(model))
    assert c.family == model
    assert c.quant.format == ("mxfp4-pack-quantized" if model in ("k3", "k31") else "pack-quantized")
    assert c.has_indexer == (model == "k31")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c["text_config"].pop("attn_res_block_size"), "attn_res_block_size"),
        (lambda c: c["text_config"]["linear_attn_config"]["kda_layers"].remove(1), "linear_attn_config"),
        (lambda c: c["text_config"].update(hidden_act="silu"), "hidden_act"),
        (lambda c: c["text_config"].update(num_experts_per_token=1000), "num_experts_per_tok"),
        (lambda c: c["text_config"].update(hidden_size="7168"), "hidden_size"),
        (lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"), "format"),
        (lambda c: c["text_config"].update(model_type="deepseek_v3"), "model_type"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    ],
    ids=["no-block-size", "layer-gap", "act", "topk", "type", "quant-format", "text-type", "arch"],
)
def test_invalid_config_names_field(mutate, field):
    """An invalid or inconsistent K3 config raises ConfigError naming the field."""
    cfg = copy.deepcopy(k3_release_config())
    mutate(cfg)
    with pytest.raises(ConfigError, match=field):
        KimiConfig.from_hf(cfg)


def test_k31_requires_indexer_fields():
    """A K3.1 config without index_topk is rejected naming index_topk."""
    cfg = tiny_config("k31")
    del cfg["text_config"]["index_topk"]
    with pytest.raises(ConfigError, match="index_topk"):
        KimiConfig.from_hf(cfg)
