"""kimi_core.config: the real published configs parse, and bad configs name the offending field."""

from __future__ import annotations

import copy

import pytest

from kimi_core.checkpoint.tiny import tiny_config
from kimi_core.config import ConfigError, KimiConfig


def k3_release_config() -> dict:
    """The published Kimi K3 config fields (shared/reference/kimi_arch.md section 0), without vision details."""
    L = 93
    full = [i for i in range(1, L + 1) if i % 4 == 0] + [93]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": {
            "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": L,
            "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "intermediate_size": 33792, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
            "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
            "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
            "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
            "mla_use_output_gate": True, "attn_res_block_size": 12,
            "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "gate_lower_bound": -5.0, "use_full_rank_gate": True, "full_attn_layers": full,
                                   "kda_layers": [i for i in range(1, L + 1) if i not in full]},
        },
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                  "strategy": "group", "group_size": 32, "symmetric": True}}},
                                "ignore": ["re:.*shared_experts.*"]},
    }


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


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c["text_config"].pop("attn_res_block_size"), "attn_res_block_size"),
    (lambda c: c["text_config"]["linear_attn_config"]["kda_layers"].remove(1), "linear_attn_config"),
    (lambda c: c["text_config"].update(hidden_act="silu"), "hidden_act"),
    (lambda c: c["text_config"].update(num_experts_per_token=1000), "num_experts_per_tok"),
    (lambda c: c["text_config"].update(hidden_size="7168"), "hidden_size"),
    (lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"), "format"),
    (lambda c: c["text_config"].update(model_type="deepseek_v3"), "model_type"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
], ids=["no-block-size", "layer-gap", "act", "topk", "type", "quant-format", "text-type", "arch"])
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
