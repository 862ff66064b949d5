"""Checkpoint I/O: lazy sharded reads with byte accounting, clear errors, atomic writes, deterministic tiny checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_core.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from kimi_core.checkpoint.tiny import make_tiny
from kimi_core.quant import FormatError, int4


def test_reader_reads_only_requested_bytes(tiny_ckpt):
    """Reading one expert's packed weight counts exactly its bytes, not the whole checkpoint."""
    r = CheckpointReader(tiny_ckpt("k2"))
    assert len(r.shards()) > 1
    t = r.get_packed("model.layers.1.mlp.experts.0.gate_proj")
    want = sum(v.numel() * v.element_size() for v in t.values())
    assert r.bytes_read == want


def test_get_weight_dequantizes_exactly(tiny_ckpt):
    """get_weight of a packed INT4 expert equals int4.dequantize of its raw tensors."""
    r = CheckpointReader(tiny_ckpt("k2"))
    m = "model.layers.2.mlp.experts.5.down_proj"
    raw = {k: r.get(f"{m}.{k}") for k in ("weight_packed", "weight_scale")}
    assert torch.equal(
        r.get_weight(m, torch.float32), int4.dequantize(raw["weight_packed"], raw["weight_scale"], torch.float32)
    )


def test_tiny_is_deterministic_and_seeded(tmp_path):
    """The same seed writes identical tensors; another seed differs."""
    a = make_tiny("k31", tmp_path / "a", seed=3)
    b = make_tiny("k31", tmp_path / "b", seed=3)
    c = make_tiny("k31", tmp_path / "c", seed=4)
    ra, rb, rc = CheckpointReader(a), CheckpointReader(b), CheckpointReader(c)
    assert ra.keys() == rb.keys()
    for k in ra.keys():
        assert torch.equal(ra.get(k), rb.get(k)), k
    assert not torch.equal(ra.get("language_model.lm_head.weight"), rc.get("language_model.lm_head.weight"))


def test_tiny_k3_release_quirks(tiny_ckpt):
    """Tiny K3: language_model.model. prefix, A_log zero-padded to head_dim, fp32 KDA scalars, last layer MLA."""
    r = CheckpointReader(tiny_ckpt("k3"))
    c = r.config
    a = r.get("language_model.model.layers.0.self_attn.A_log")
    assert a.dtype == torch.float32 and a.shape == (c.linear_attn.head_dim,)
    assert (a[c.linear_attn.num_heads :] == 0).all() and (a[: c.linear_attn.num_heads] != 0).all()
    assert r.get("language_model.model.layers.0.self_attn.q_conv1d.weight").dtype == torch.float32
    last = c.num_hidden_layers - 1
    assert r.has(f"language_model.model.layers.{last}.self_attn.kv_a_proj_with_mqa.weight")
    assert r.get("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed").dtype == torch.uint8
    assert c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64  # vLLM CPU MLA needs 512 + 64


def test_writer_is_atomic_and_keeps_modules_together(tmp_path):
    """Shards are cut only between modules and no temporary files remain."""
    tensors = {f"m{i}.weight_packed": torch.zeros(64, 8, dtype=torch.int32) for i in range(6)}
    tensors.update({f"m{i}.weight_scale": torch.ones(64, 2, dtype=torch.bfloat16) for i in range(6)})
    names = write_checkpoint(str(tmp_path), tensors, {"a": 1}, max_shard_bytes=3000)
    assert len(names) > 1
    wm = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    for i in range(6):
        assert wm[f"m{i}.weight_packed"] == wm[f"m{i}.weight_scale"]
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def _broken_copy(src, dst, mutate):
    os.makedirs(dst)
    for f in os.listdir(src):
        p = os.path.join(src, f)
        if f.endswith(".safetensors"):
            sd = load_file(p)
            mutate(sd)
            save_file(sd, os.path.join(dst, f))
        else:
            open(os.path.join(dst, f), "w").write(open(p).read())


def test_missing_scale_names_tensor(tiny_ckpt, tmp_path):
    """A packed expert without its weight_scale fails naming the missing tensor."""
    m = "model.layers.1.mlp.experts.2.up_proj"

    def drop(sd):
        sd.pop(f"{m}.weight_scale", None)

    _broken_copy(tiny_ckpt("k2"), tmp_path / "x", drop)
    # the index still lists the tensor, so rebuild it from the shards
    os.remove(tmp_path / "x" / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=f"{m}.weight_scale"):
        CheckpointReader(tmp_path / "x").get_weight(m)


def test_wrong_format_names_tensor(tiny_ckpt, tmp_path):
    """An MXFP4 checkpoint whose config claims INT4 fails naming the packed tensor and the format."""
    d = tmp_path / "y"
    _broken_copy(tiny_ckpt("k3"), d, lambda sd: None)
    cfg = json.load(open(d / "config.json"))
    cfg["quantization_config"]["format"] = "pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    json.dump(cfg, open(d / "config.json", "w"))
    r = CheckpointReader(d)
    with pytest.raises(Exception, match="pack-quantized"):
        _ = r.config  # K3 experts must be MXFP4: the config itself is inconsistent
    m = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    r._config = __import__("kimi_core.config", fromlist=["KimiConfig"]).KimiConfig.from_hf(
        json.load(open(tiny_ckpt("k2") + "/config.json"))
    )
    with pytest.raises(FormatError, match=f"{m}.weight_packed"):
        r.get_weight(m)


def test_shape_mismatch_names_tensor(tiny_ckpt):
    """get_weight with the config's expected shape fails naming the tensor when they differ."""
    r = CheckpointReader(tiny_ckpt("k2"))
    with pytest.raises(CheckpointError, match="q_a_proj"):
        r.get_weight("model.layers.0.self_attn.q_a_proj", shape=(7, 7))


def test_missing_directory_is_clear(tmp_path):
    """A missing checkpoint directory raises CheckpointError naming the path."""
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
