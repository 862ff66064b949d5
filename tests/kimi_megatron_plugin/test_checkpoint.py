"""Native HF checkpoint import/export: bit-exact round trip and errors that name the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kimi_core.checkpoint import CheckpointReader, write_checkpoint


def _build(path, **kw):
    from kimi_megatron_plugin.models import provider

    return provider.build_model_from_hf(path, perform_initialization=False, **kw)


@pytest.mark.parametrize("family", ["k2", "k31"])
def test_export_round_trip_bit_exact(family, tiny_ckpt, mcore_world):
    """load -> export gives every HF tensor back with the same name, dtype and bits (A_log padding included)."""
    from kimi_megatron_plugin import checkpoint

    path = tiny_ckpt(family, layers=4)
    model = _build(path)
    checkpoint.load_hf_checkpoint(model, path)
    out = checkpoint.export_hf_state_dict(model)
    reader = CheckpointReader(path)
    assert set(out) == set(reader.keys())
    for name in reader.keys():
        want = reader.get(name)
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    reader = CheckpointReader(src)
    tensors = {k: reader.get(k).clone() for k in reader.keys()}
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    shutil.rmtree(dst, ignore_errors=True)
    write_checkpoint(dst, tensors, cfg)
    return dst


def test_missing_scale_names_tensor(tiny_ckpt, tmp_path, mcore_world):
    """A routed expert without its weight_scale fails with the missing tensor's name."""
    from kimi_megatron_plugin import checkpoint

    src = tiny_ckpt("k2", layers=2)
    bad = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    dst = _rewrite(src, str(tmp_path / "noscale"), edit_tensors=lambda t: t.pop(bad))
    model = _build(dst)
    with pytest.raises(KeyError, match="experts.3.up_proj.weight_scale"):
        checkpoint.load_hf_checkpoint(model, dst)


def test_wrong_quant_format_names_tensor(tiny_ckpt, tmp_path, mcore_world):
    """INT4 expert bytes under a config that declares a different packed dtype fail naming the tensor."""
    from kimi_megatron_plugin import checkpoint

    src = tiny_ckpt("k2", layers=2)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_packed"

    def to_uint8(t):
        t[name] = t[name].view(torch.uint8)[:, : t[name].shape[1]].contiguous()

    dst = _rewrite(src, str(tmp_path / "fmt"), edit_tensors=to_uint8)
    model = _build(dst)
    with pytest.raises(Exception, match="experts.0.gate_proj.weight_packed"):
        checkpoint.load_hf_checkpoint(model, dst)


def test_wrong_quant_format_in_config(tiny_ckpt, tmp_path):
    """A K2 config declaring MXFP4 experts is refused at config parse time, naming the field."""
    from kimi_core.config import ConfigError, load_config

    src = tiny_ckpt("k2", layers=2)

    def fmt(cfg):
        cfg["quantization_config"]["format"] = "mxfp4-pack-quantized"
        cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "mxfp4-pack-quantized"
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"

    dst = _rewrite(src, str(tmp_path / "cfgfmt"), edit_config=fmt)
    with pytest.raises(ConfigError, match="quantization_config.format"):
        load_config(dst)


def test_shape_mismatch_names_tensor(tiny_ckpt, tmp_path, mcore_world):
    """A config/weight shape disagreement names the HF tensor, the megatron parameter and both shapes."""
    from kimi_megatron_plugin import checkpoint

    src = tiny_ckpt("k3", layers=2)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"

    def shrink(t):
        t[name] = t[name][:-32].clone()

    dst = _rewrite(src, str(tmp_path / "shape"), edit_tensors=shrink)
    model = _build(dst)
    with pytest.raises(KeyError, match=r"layers\.0\.self_attn\.q_proj\.weight.*shape"):
        checkpoint.load_hf_checkpoint(model, dst)


def test_a_log_hooks_round_trip():
    """A_log import strips zero padding (non-zero padding is an error) and export restores it."""
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.config import KimiConfig
    from kimi_megatron_plugin.mapping import A_LOG_HOOKS

    kimi = KimiConfig.from_hf(tiny_config("k3", layers=2))
    imp, exp = A_LOG_HOOKS
    padded = torch.zeros(32)
    padded[:4] = torch.arange(1.0, 5.0)
    assert torch.equal(exp(imp(padded, kimi, "A_log"), kimi, "A_log", (32,)), padded)
    padded[10] = 1.0
    with pytest.raises(ValueError, match="A_log"):
        imp(padded, kimi, "A_log")
