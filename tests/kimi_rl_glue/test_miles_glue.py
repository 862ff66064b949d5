"""miles glue on CPU: ``--custom-megatron-init-path`` and ``--lora-provider-path`` with a tiny K2 model."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[megatron]')")

from kimi_core.lora import Adapter, random_adapter
from kimi_rl_glue.miles import lora_provider as lp


def _miles_load_function(path: str):
    """What ``miles.utils.misc.load_function`` does with a dotted path (no registry entry)."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def _args(path, **kw):
    base = dict(
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules="all-linear",
        exclude_modules=None,
        experts_shared_outer_loras=False,
        hf_checkpoint=path,
        seed=0,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_init_resolves_as_miles_does_and_logs_missing_bridge(caplog):
    """Both spellings resolve to one callable through miles' load_function rule; no Bridge is a log line."""
    fn = _miles_load_function("kimi_rl_glue.miles.init")
    assert callable(fn) and fn is _miles_load_function("kimi_rl_glue.miles.init.init")
    with caplog.at_level(logging.INFO, logger="kimi_rl_glue.miles.init"):
        done = fn(SimpleNamespace())
    assert done["cpu_shims"] == (not torch.cuda.is_available())
    if done["bridge"] is None:
        assert "megatron.bridge is not installed" in caplog.text
    assert fn(SimpleNamespace())["bridge"] == done["bridge"]  # idempotent


def test_spec_from_miles_flags():
    """HF and Megatron leaf names, both expert families, exclusions; bad flags are named."""
    s = lp.lora_spec_from_args(
        _args(
            "",
            target_modules=["linear_proj", "linear_fc1"],
            exclude_modules="linear_fc2",
            experts_shared_outer_loras=True,
        )
    )
    assert s.target_modules == ("o_proj", "gate_proj", "w1", "up_proj", "w3")
    assert s.exclude_modules == ("down_proj", "w2") and s.expert_layout == "shared_outer"
    assert lp.lora_spec_from_args(_args("")).target_modules == "all-linear"
    with pytest.raises(lp.LoraProviderError, match="--lora-dropout"):
        lp.lora_spec_from_args(_args("", lora_dropout=0.1))
    with pytest.raises(lp.LoraProviderError, match="--lora-rank"):
        lp.lora_spec_from_args(_args("", lora_rank=0))


def test_provider_load_export_round_trip(mcore_world, tiny_ckpt, tmp_path):
    """Wrapped provider -> LoRA in the chunk's parameters (hidden from its state dict); an adapter loaded with
    load_lora_adapter_hf comes back bit-exact from export_lora_hf_named under HF/PEFT names, and miles' saved
    form of that export loads again."""
    from kimi_megatron_plugin.models import provider

    path = tiny_ckpt("k2", layers=2)

    def miles_provider(pre_process=True, post_process=True, vp_stage=None):
        m = provider.build_model_from_hf(
            path, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, perform_initialization=False
        )
        del m.kimi_config  # a model built from miles' --spec has no kimi_config: the wrapper reads --hf-checkpoint
        return m

    args = _args(path, exclude_modules="kv_b_proj")
    model = lp.wrap_model_provider_with_lora(miles_provider, args)(True, True, vp_stage=None)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(lp.SLOT + ".") for n in trainable)
    assert not any(lp.SLOT in k for k in model.state_dict())
    missing, _ = model.load_state_dict(model.state_dict(), strict=True)
    assert missing == []

    spec = lp.lora_spec_from_args(args)
    ad = random_adapter(model.kimi_config, spec, seed=3, dtype=torch.bfloat16)
    ad.save(tmp_path / "in")
    assert lp.load_lora_adapter_hf([model], str(tmp_path / "in")) == len(trainable)
    named = lp.export_lora_hf_named([model])
    want = {k.removeprefix("base_model.model."): v for k, v in ad.tensors.items()}
    got = dict(named)
    assert len(got) == len(named) and set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    assert all(k.startswith("model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in got)
    assert any(".mlp.experts.0.gate_proj.lora_A.weight" in k for k in got)
    assert not any("kv_b_proj" in k for k in got)

    # miles writes the export as adapter_model.safetensors (no PEFT prefix); reload into zeroed factors
    Adapter(got, ad.adapter_config).save(tmp_path / "miles")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    lp.load_lora_adapter_hf(model, str(tmp_path / "miles"))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(lp.export_lora_hf_named(model), named))


def test_unwrapped_model_is_named(mcore_world, tiny_ckpt):
    """A chunk built without the wrapper: the error names the flag to set."""
    from kimi_megatron_plugin.models import provider

    m = provider.build_model_from_hf(tiny_ckpt("k2", layers=2), perform_initialization=False)
    with pytest.raises(lp.LoraProviderError, match="--lora-provider-path"):
        lp.export_lora_hf_named([m])
