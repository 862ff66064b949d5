"""LoraSpec and the PEFT adapter_config.json it writes and reads."""

from __future__ import annotations

import json
import re

import pytest

from kimi_core.lora import AdapterConfigError, LoraSpec, read_adapter_config, write_adapter_config
from kimi_core.lora.config import module_rank_alpha


def _peft_lookup(pattern: dict, name: str):
    """PEFT's rule written out independently: first key k with (.*\\.)?(k)$ matching the name."""
    for k, v in pattern.items():
        if re.match(r"(.*\.)?(" + k + r")$", name):
            return v
    return None


def test_spec_rejects_bad_fields():
    """Invalid rank, alpha or expert layout raise AdapterConfigError naming the field."""
    with pytest.raises(AdapterConfigError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(AdapterConfigError, match="alpha"):
        LoraSpec(alpha=-1)
    with pytest.raises(AdapterConfigError, match="expert_layout"):
        LoraSpec(expert_layout="stacked")


def test_normalized_expert_rank_divides_or_raises(k2_tiny):
    """normalize_moe_lora gives experts rank // top_k and refuses a rank top_k does not divide."""
    assert LoraSpec(rank=8, normalize_moe_lora=True).expert_rank(k2_tiny.num_experts_per_tok) == 4
    assert LoraSpec(rank=8).expert_rank(2) == 8
    with pytest.raises(AdapterConfigError, match="not divisible by the router top-k 2"):
        LoraSpec(rank=7, normalize_moe_lora=True).expert_rank(k2_tiny.num_experts_per_tok)


@pytest.mark.parametrize("layout", ["per_expert", "per_expert_3d", "shared_outer", "stacked"])
def test_adapter_config_fields_and_patterns(k3_tiny, layout):
    """The PEFT dict has the required fields, and PEFT's pattern rule gives experts rank r//k, others r."""
    spec = LoraSpec(
        rank=8,
        alpha=16,
        normalize_moe_lora=True,
        expert_layout="shared_outer",
        base_model_name_or_path="moonshotai/Kimi-K3",
    )
    d = spec.to_adapter_config(k3_tiny, layout)
    assert d["peft_type"] == "LORA" and d["bias"] == "none" and d["r"] == 8 and d["lora_alpha"] == 16
    assert d["base_model_name_or_path"] == "moonshotai/Kimi-K3"
    assert {"q_a_proj", "kv_a_proj_with_mqa", "o_proj", "routed_expert_down_proj", "f_a_proj"} <= set(
        d["target_modules"]
    )
    moe = "language_model.model.layers.1.block_sparse_moe"
    expert_name = {
        "per_expert": f"{moe}.experts.3.w1",
        "per_expert_3d": f"{moe}.experts.w1",
        "shared_outer": f"{moe}.experts.w2",
        "stacked": f"{moe}.experts.gate_up_proj",
    }[layout]
    assert _peft_lookup(d["rank_pattern"], expert_name) == 4
    assert _peft_lookup(d["alpha_pattern"], expert_name) == 16
    for other in (
        f"{moe}.shared_experts.gate_proj",
        "language_model.model.layers.1.self_attn.q_a_proj",
        f"{moe}.routed_expert_up_proj",
    ):
        assert _peft_lookup(d["rank_pattern"], other) is None, other
        assert module_rank_alpha(d, other) == (8, 16.0)
    if layout == "stacked":
        assert d["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
        assert "w1" not in d["target_modules"]
    else:
        assert {"w1", "w2", "w3"} <= set(d["target_modules"])


def test_adapter_config_file_round_trip(tmp_path, k2_tiny):
    """write_adapter_config is atomic JSON that read_adapter_config and from_adapter_config read back."""
    spec = LoraSpec(
        rank=8,
        alpha=4,
        normalize_moe_lora=True,
        exclude_modules=("kv_b_proj",),
        base_model_name_or_path="moonshotai/Kimi-K2.6",
    )
    path = write_adapter_config(spec.to_adapter_config(k2_tiny), tmp_path)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    d = read_adapter_config(tmp_path)
    assert json.load(open(path)) == d
    back = LoraSpec.from_adapter_config(d)
    assert back == spec


def test_adapter_config_validation_names_field(tmp_path):
    """A missing r, a DoRA config or a bad regex key is rejected with the file and field named."""
    p = tmp_path / "adapter_config.json"
    p.write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8}))
    with pytest.raises(AdapterConfigError, match=r"adapter_config.json: missing required field 'r'"):
        read_adapter_config(tmp_path)
    p.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(AdapterConfigError, match="use_dora"):
        read_adapter_config(tmp_path)
    p.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "rank_pattern": {"experts(": 2}}))
    with pytest.raises(AdapterConfigError, match="rank_pattern key"):
        read_adapter_config(tmp_path)
    with pytest.raises(AdapterConfigError, match="file not found"):
        read_adapter_config(tmp_path / "nope")


def test_saved_adapter_is_group_readable(tmp_path):
    """An adapter folder written by Adapter.save / save_replacing gets open()'s modes under the umask (0644 files,
    0755 folder under umask 022), so an engine running as another user on shared storage can read it."""
    import os
    import stat

    import torch

    from kimi_core.lora.adapter import Adapter

    cfg = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}
    ad = Adapter(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
        },
        cfg,
    )
    old = os.umask(0o022)
    try:
        d = ad.save_replacing(tmp_path / "v1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    for name in os.listdir(d):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o644, name
