"""Config fixtures shared by the kimi_core tests: tiny K2 / K2.5 / K3 / K3.1 configs and the published K2 / K3 ones
(values from kimi_core.release_configs)."""

from __future__ import annotations

import copy

import pytest

from kimi_core.config import KimiConfig
from kimi_core.release_configs import k2_release_config as k2_real_dict
from kimi_core.release_configs import k3_release_config as k3_real_dict


def k2_tiny_dict(family: str = "k2") -> dict:
    text = {
        "model_type": "kimi_k2",
        "hidden_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "vocab_size": 128,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 6,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 20,
        "intermediate_size": 40,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
    }
    if family == "k2":
        return {"architectures": ["DeepseekV3ForCausalLM"], **text}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}


def k3_tiny_dict(family: str = "k3") -> dict:
    d = copy.deepcopy(k3_real_dict())
    t = d["text_config"]
    t.update(
        hidden_size=40,
        num_hidden_layers=4,
        intermediate_size=36,
        num_experts=5,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=12,
        routed_expert_hidden_size=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=20,
        kv_lora_rank=12,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=6,
        attn_res_block_size=2,
        vocab_size=64,
    )
    t["linear_attn_config"].update(num_heads=2, head_dim=8, full_attn_layers=[2, 4], kda_layers=[1, 3])
    if family == "k31":
        d["architectures"] = ["KimiK31ForConditionalGeneration"]
        t.update(index_n_heads=2, index_head_dim=8, index_topk=4)
    return d


@pytest.fixture(scope="session")
def k2_tiny():
    return KimiConfig.from_hf(k2_tiny_dict("k2"))


@pytest.fixture(scope="session")
def k25_tiny():
    return KimiConfig.from_hf(k2_tiny_dict("k25"))


@pytest.fixture(scope="session")
def k3_tiny():
    return KimiConfig.from_hf(k3_tiny_dict("k3"))


@pytest.fixture(scope="session")
def k31_tiny():
    return KimiConfig.from_hf(k3_tiny_dict("k31"))


@pytest.fixture(scope="session")
def k2_real():
    return KimiConfig.from_hf(k2_real_dict())


@pytest.fixture(scope="session")
def k3_real():
    return KimiConfig.from_hf(k3_real_dict())


@pytest.fixture(params=["k2", "k25", "k3", "k31"])
def tiny(request, k2_tiny, k25_tiny, k3_tiny, k31_tiny):
    """Each tiny family in turn."""
    return {"k2": k2_tiny, "k25": k25_tiny, "k3": k3_tiny, "k31": k31_tiny}[request.param]
