"""Published configs of the Kimi releases as dicts (text parts; vision towers omitted).

Values from the published ``config.json`` of ``moonshotai/Kimi-K3`` (K3) and the Kimi K2 / K2.5
releases, as summarised in ``docs/models.md``. K3.1 is K3 plus the DSA indexer fields, whose names and values
(32 heads x 128, top-2048) are **inferred**: no public K3.1 config exists. Used for size tables,
docs and config tests; never downloaded at run time.
"""

from __future__ import annotations

import copy

from kimi_core.architectures import K2, K3, K31
from kimi_core.quant.formats import MXFP4


def k2_release_config() -> dict:
    """Kimi K2 (DeepSeek-V3 architecture) text config, kimi_arch.md section 5."""
    return {
        "architectures": [K2],
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "vocab_size": 163840,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 262144,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    }


def k3_release_config() -> dict:
    """Kimi K3 (``moonshotai/Kimi-K3``) config, kimi_arch.md section 0 (vision config omitted)."""
    full = [4 * i for i in range(1, 24)] + [93]
    kda = [i for i in range(1, 94) if i not in full]
    return {
        "architectures": [K3],
        "model_type": "kimi_k3",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "kimi_linear",
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "intermediate_size": 33792,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "num_experts": 896,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "routed_scaling_factor": 1.0,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "attn_res_block_size": 12,
            "linear_attn_config": {
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0,
                "use_full_rank_gate": True,
                "full_attn_layers": full,
                "kda_layers": kda,
            },
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": MXFP4.name,
            "config_groups": {
                "group_0": {
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "strategy": "group",
                        "group_size": 32,
                        "symmetric": True,
                        "dynamic": False,
                        "scale_dtype": "torch.uint8",
                    }
                }
            },
            "ignore": ["lm_head", "re:.*shared_experts.*"],
        },
    }


def k31_release_config() -> dict:
    """Kimi K3.1: K3 plus the lightning indexer (field names and values inferred, see module docstring)."""
    d = copy.deepcopy(k3_release_config())
    d["architectures"] = [K31]
    d["model_type"] = "kimi_k31"
    d["text_config"].update(index_n_heads=32, index_head_dim=128, index_topk=2048)
    return d
