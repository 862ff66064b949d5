"""Checkpoint writes are tied to their input, group-readable, and survive a SIGKILL: ``make-tiny`` over an older
checkpoint keeps none of its shards; ``dequantize`` resumes only into a folder made from the same input and
settings, and a run killed midway is finished by the next one with nothing mixed."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from kimi_core.checkpoint import CheckpointReader
from kimi_core.checkpoint.dequantize import RECORD_NAME, dequantize_checkpoint
from kimi_core.checkpoint.folders import FolderRefused
from kimi_core.checkpoint.tiny import make_tiny

KIMI_RL = [sys.executable, "-m", "kimi_rl_glue.cli"]


def _modes(folder) -> dict[str, int]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = os.path.join(root, n)
            out[os.path.relpath(p, folder)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_written_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """make-tiny and dequantize outputs get open()'s mode under the umask (0644 / 0755 under 022), as config.json
    does, not safetensors' 0600."""
    old = os.umask(umask)
    try:
        a = make_tiny("k2", tmp_path / "A", layers=2)
        dequantize_checkpoint(a, str(tmp_path / "B"), progress=False)
    finally:
        os.umask(old)
    for folder in (tmp_path / "A", tmp_path / "B"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == dir_mode
        modes = _modes(folder)
        assert any(n.endswith(".safetensors") for n in modes)
        assert {n: m for n, m in modes.items() if m != file_mode} == {}, folder


def test_make_tiny_over_a_larger_checkpoint_keeps_none_of_its_shards(tmp_path):
    """A 2-layer checkpoint written over a 6-layer one holds exactly the shards its index lists."""
    out = tmp_path / "ck"
    make_tiny("k2", out, layers=6)
    big = {n for n in os.listdir(out) if n.endswith(".safetensors")}
    make_tiny("k2", out, layers=2)
    with open(out / "model.safetensors.index.json") as f:
        listed = set(json.load(f)["weight_map"].values())
    assert {n for n in os.listdir(out) if n.endswith(".safetensors")} == listed
    assert len(listed) < len(big)
    assert CheckpointReader(out).config.num_hidden_layers == 2
    assert [n for n in os.listdir(tmp_path) if n != "ck"] == []  # no temporary folder left beside it


def test_dequantize_resumes_only_the_same_input_and_settings(tmp_path, tiny_ckpt):
    """Same input and settings: finished shards are skipped. Another checkpoint (K3 into a K2 output) or other
    settings: refused naming what differs, the folder untouched."""
    b = str(tmp_path / "B")
    dequantize_checkpoint(tiny_ckpt("k2"), b, progress=False)
    rep = dequantize_checkpoint(tiny_ckpt("k2"), b, progress=False)
    assert rep.skipped_shards and not rep.written_shards
    snapshot = {n: os.path.getmtime(os.path.join(b, n)) for n in os.listdir(b)}
    with pytest.raises(FolderRefused, match="config.json differs.*shard"):
        dequantize_checkpoint(tiny_ckpt("k3"), b, progress=False)
    with pytest.raises(FolderRefused, match="verify was True, now False"):
        dequantize_checkpoint(tiny_ckpt("k2"), b, verify=False, progress=False)
    # another seed: the same names, shapes and config, other weights
    with pytest.raises(FolderRefused, match="data differs"):
        dequantize_checkpoint(tiny_ckpt("k2", seed=1), b, progress=False)
    assert {n: os.path.getmtime(os.path.join(b, n)) for n in os.listdir(b)} == snapshot


def test_dequantize_killed_midway_is_finished_by_the_rerun(tmp_path):
    """SIGKILL after the first finished shard; the rerun into the same folder finishes it, and the result equals a
    clean run's: the same files, equal tensors, no temporary or stray part left."""
    a = make_tiny("k2", tmp_path / "A", layers=6, max_shard_bytes=48 * 1024)
    b, clean = tmp_path / "B", tmp_path / "C"
    p = subprocess.Popen(
        [*KIMI_RL, "dequantize", "--input", a, "--output", str(b)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if b.exists() and any(n.endswith(".dequantized.json") for n in os.listdir(b)):
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "dequantize finished before it could be killed midway"
    assert (b / RECORD_NAME).exists() and not (b / "model.safetensors.index.json").exists()
    r = subprocess.run([*KIMI_RL, "dequantize", "--input", a, "--output", str(b)], capture_output=True, text=True)
    assert r.returncode == 0 and "finished earlier from the same input" in r.stdout, r.stderr
    dequantize_checkpoint(a, str(clean), progress=False)
    assert sorted(os.listdir(b)) == sorted(os.listdir(clean))
    rb, rc = CheckpointReader(b), CheckpointReader(clean)
    assert rb.keys() == rc.keys()
    for k in rc.keys():
        assert torch.equal(rb.get(k), rc.get(k)), k


def test_leftovers_of_a_killed_writer_are_recognised(tmp_path):
    """A kill inside safetensors' own write leaves its Rust ``tempfile`` (``.tmp`` + six characters) beside our
    ``.<name>.tmp.<pid>``: the rerun's clean-up knows both, and nothing a checkpoint holds."""
    from safetensors.torch import save_file

    from kimi_core.checkpoint.writer import is_temporary

    save_file({"a": torch.zeros(4)}, str(tmp_path / "probe.safetensors"))
    assert os.listdir(tmp_path) == ["probe.safetensors"]  # the writer renamed its temporary file
    for name in (".tmpiuEMRV", ".tmp0aZ9xQ", ".model-00001-of-00002.safetensors.tmp.4242", ".config.json.tmp.7"):
        assert is_temporary(name), name
    for name in ("model-00001-of-00002.safetensors", "config.json", ".tmpiuEMRVx", "tmpiuEMRV", ".tmp", ".gitkeep"):
        assert not is_temporary(name), name
