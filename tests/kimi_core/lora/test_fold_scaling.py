"""fold_pattern_scaling: a reader applying one global alpha / r serves the folded adapter exactly as a
PEFT reader (rank_pattern / alpha_pattern) serves the original."""

from __future__ import annotations

import pytest
import torch

from kimi_core.lora import AdapterError, LoraSpec, load_adapter, random_adapter
from kimi_core.lora.fold_scaling import PEFT_PREFIX, fold_pattern_scaling


def _global_rule_deltas(adapter) -> dict[str, torch.Tensor]:
    """float64 ``delta W`` of every module as a reader without patterns computes it: ``lora_alpha / r`` for all."""
    cfg = adapter.adapter_config
    s = cfg["lora_alpha"] / cfg["r"]
    out = {}
    for name, a in adapter.tensors.items():
        if name.endswith(".lora_A.weight"):
            key = name[: -len(".lora_A.weight")]
            b = adapter.tensors[f"{key}.lora_B.weight"]
            out[key[len(PEFT_PREFIX) :]] = s * b.double() @ a.double()
    return out


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_adapter_under_global_scaling_equals_peft_rules(k2_tiny, layout, dtype):
    """Capacity-normalised experts (rank 8 // top-2 = 4, alpha 16): every module's global-rule delta of
    the folded adapter equals the PEFT-rule delta of the original (load_adapter), bit for bit in float64."""
    ad = random_adapter(
        k2_tiny,
        LoraSpec(rank=8, alpha=16.0, expert_layout=layout, normalize_moe_lora=True),
        seed=3,
        layout="per_expert",
        dtype=dtype,
        b_std=0.3,
    )
    assert ad.adapter_config["rank_pattern"], "the test needs an adapter with patterns"
    folded = fold_pattern_scaling(ad)
    assert folded.adapter_config["rank_pattern"] == {} and folded.adapter_config["alpha_pattern"] == {}
    assert folded.adapter_config["r"] == 8 and folded.adapter_config["lora_alpha"] == 16.0
    assert folded.adapter_config["kimi_rl"]["folded_scaling"]["ratios"] == [2.0]  # (16/4) / (16/8)
    peft = load_adapter(ad, k2_tiny)
    got = _global_rule_deltas(folded)
    experts = 0
    for module, dw in got.items():
        if ".experts." in module:
            moe, rest = module.split(".experts.")
            e, proj = rest.split(".")
            f = peft.expert(moe, int(e), proj)
            experts += 1
        else:
            f = peft.dense(module)
        assert torch.equal(dw, f.delta_weight(torch.float64)), module
    assert experts == 2 * 6 * 3  # 2 MoE layers x 6 experts x 3 projections
    # the unfolded adapter under the global rule is what vLLM 0.26 served: experts 2x too weak here
    raw = _global_rule_deltas(ad)
    m = "model.layers.1.mlp.experts.0.down_proj"
    torch.testing.assert_close(raw[m] * 2, got[m], rtol=0, atol=0)


def test_adapter_without_patterns_is_unchanged(k2_tiny):
    """A uniform-rank adapter folds to an equal copy (same tensors, same r / alpha)."""
    ad = random_adapter(k2_tiny, LoraSpec(rank=4, alpha=8.0), seed=1)
    folded = fold_pattern_scaling(ad)
    assert folded is not ad and folded.adapter_config == ad.adapter_config
    assert all(torch.equal(folded.tensors[k], v) for k, v in ad.tensors.items())


def test_lora_b_without_lora_a_is_named(k2_tiny):
    """A lora_B whose lora_A is missing is refused with the tensor's name (its scaling cannot be resolved)."""
    ad = random_adapter(k2_tiny, LoraSpec(rank=4, alpha=8.0, normalize_moe_lora=True), seed=1)
    name = sorted(k for k in ad.tensors if ".experts." in k and k.endswith("lora_A.weight"))[0]
    del ad.tensors[name]
    with pytest.raises(AdapterError, match=name.replace("lora_A", "lora_B").replace(".", r"\.")):
        fold_pattern_scaling(ad)
