"""The pure parts of ``kimi_rl_glue.skyrl.worker``: SkyRL's LoRA and expert settings mapped onto the Kimi ones.

The worker class itself subclasses SkyRL's Megatron worker (CUDA, Ray); it runs in ``tools/gpu/skyrl_loop.sh``.
"""

from types import SimpleNamespace as NS

import pytest

from kimi_core.errors import PluginError
from kimi_core.lora import ALL_LINEAR
from kimi_rl_glue.skyrl.worker import expert_mode_of, lora_spec_of


def _model(weights="int4", qat=False, group=32, normalize=True):
    fq = NS(enabled=qat, group_size=group, scale_divisor=7.0, q_min=-7.0, bf16_base_path=None)
    return NS(kimi=NS(expert_weights=weights, normalize_moe_lora=normalize), fake_int4_qat=fq)


def _lora(targets="all-linear", dropout=0.0, exclude=None):
    return NS(rank=32, alpha=64, dropout=dropout, target_modules=targets, exclude_modules=exclude)


def test_expert_modes():
    assert expert_mode_of(_model("int4"), 32) == ("w4a16", {})
    assert expert_mode_of(_model("bf16"), 32) == ("dense", {})
    assert expert_mode_of(_model("bf16", qat=True), 32) == ("qat", {"scale_divisor": 7.0, "q_min": -7.0})
    with pytest.raises(PluginError, match="group_size=16.*groups of 32"):
        expert_mode_of(_model("bf16", qat=True, group=16), 32)


def test_lora_spec_from_skyrl_names():
    spec = lora_spec_of(_lora(["linear_proj", "linear_fc1", "linear_fc2"]), _model(), "/ckpt")
    assert spec.target_modules == ("o_proj", "gate_proj", "w1", "up_proj", "w3", "down_proj", "w2")
    assert (spec.rank, spec.alpha, spec.normalize_moe_lora, spec.base_model_name_or_path) == (32, 64.0, True, "/ckpt")
    assert spec.expert_rank(8) == 4
    # SkyRL's dotlist can hand the list over as its string form
    assert lora_spec_of(_lora("['linear_proj']"), _model(), "/c").target_modules == ("o_proj",)
    assert lora_spec_of(_lora(), _model(), "/c").target_modules == ALL_LINEAR
    assert lora_spec_of(_lora(exclude="linear_kv_up_proj"), _model(), "/c").exclude_modules == ("kv_b_proj",)
    assert lora_spec_of(_lora(), _model(), "/c").expert_layout == "per_expert"
    assert lora_spec_of(_lora(), _model(), "/c", shared_outer=True).expert_layout == "shared_outer"


def test_lora_spec_refusals_name_the_key():
    with pytest.raises(PluginError, match="lora.dropout=0.1"):
        lora_spec_of(_lora(dropout=0.1), _model(), "/c")
    with pytest.raises(PluginError, match="lora_config.normalize_moe_lora=False.*kimi.normalize_moe_lora=True"):
        lora_spec_of(_lora(), _model(), "/c", skyrl_normalize=False)
    with pytest.raises(PluginError, match="target_modules is empty"):
        lora_spec_of(_lora([]), _model(), "/c")
