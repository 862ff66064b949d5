"""check-numerics with the Megatron trainer engine: equal to the reference, and a broken model is caught."""

from __future__ import annotations

import importlib.util

import pytest
from utils import perturb_expert_scales

from kimi_rl_glue.numerics import compare

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_reference_vs_megatron(tiny_ckpt, tmp_path, with_adapter):
    """The Megatron model (W4A16 experts, LoRA hooks) matches the fp32 reference on sampled tokens and every layer."""
    ckpt = tiny_ckpt("k2")
    adapter = None
    if with_adapter:
        from kimi_core.config import load_config
        from kimi_core.lora import LoraSpec, random_adapter

        spec = LoraSpec(rank=8, alpha=16, exclude_modules=("kv_b_proj",), normalize_moe_lora=True)
        adapter = random_adapter(load_config(ckpt), spec, seed=2, b_std=0.05).save(str(tmp_path / "adapter"))
    rep = compare(
        ckpt, adapter=adapter, engines=["reference", "megatron"], tokens=8, dtype="fp32", batch=2, prompt_len=8
    )
    (p,) = rep.pairs
    print(rep.table())
    assert p.max_abs < 1e-4 and p.top1_agree == 1.0 and not p.flagged
    assert max(p.layer_errors) < 1e-5


def test_wrong_model_is_flagged_at_its_layer(tiny_ckpt, tmp_path):
    """Megatron on a checkpoint whose layer-2 expert scales are perturbed is flagged at layer 2 against the reference."""
    bad = str(tmp_path / "bad")
    perturb_expert_scales(tiny_ckpt("k2"), bad, layer=2, factor=1.25)
    rep = compare(
        tiny_ckpt("k2"), engines=["reference", f"megatron@{bad}"], tokens=8, dtype="fp32", batch=1, prompt_len=8
    )
    (p,) = rep.pairs
    print(rep.table())
    assert p.flagged and p.first_diverging_layer == 3 and "layer 2" in rep.table()
