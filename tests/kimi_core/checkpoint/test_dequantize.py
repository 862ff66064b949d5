"""`kimi-rl dequantize`: verified BF16 masters, exit code 2 on RTN checkpoints, resumability, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kimi_core.checkpoint import CheckpointReader, write_checkpoint
from kimi_core.quant import int4

KIMI_RL = [sys.executable, "-m", "kimi_rl_glue.cli"]


def _run(*args):
    return subprocess.run([*KIMI_RL, *args], capture_output=True, text=True)


@pytest.mark.parametrize("model, extra", [("k2", []), ("k3", []), ("k2", ["--size", "small"])])
def test_make_tiny_then_dequantize_exits_0(model, extra, tmp_path):
    """make-tiny (release format; also the GPU demos' small K2) then dequantize exits 0 and every master equals
    the exact dequantization."""
    a, b = tmp_path / "A", tmp_path / "B"
    assert _run("make-tiny", "--model", model, "--out", str(a), *extra).returncode == 0
    r = _run("dequantize", "--input", str(a), "--output", str(b))
    assert r.returncode == 0, r.stderr
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert rb.config.quant is None
    packed = [k[: -len(".weight_packed")] for k in ra.keys() if k.endswith(".weight_packed")]
    assert packed
    for m in packed[:: max(1, len(packed) // 20)]:
        assert torch.equal(rb.get(f"{m}.weight"), ra.get_weight(m, torch.bfloat16)), m
    others = [k for k in ra.keys() if not k.rsplit(".", 1)[-1].startswith("weight_")]
    for k in others[:20]:
        assert torch.equal(rb.get(k), ra.get(k)), k


@pytest.mark.parametrize("model, extra", [("k2", ["--convention", "rtn"])])
def test_rtn_checkpoint_exits_2_naming_tensors(model, extra, tmp_path):
    """Dequantizing an RTN checkpoint with the default Kimi convention exits 2, names tensors and gives the hint."""
    a, b = tmp_path / "A", tmp_path / "B"
    assert _run("make-tiny", "--model", model, "--out", str(a), *extra).returncode == 0
    r = _run("dequantize", "--input", str(a), "--output", str(b))
    assert r.returncode == 2
    assert "experts.0" in r.stderr and "RTN" in r.stderr
    assert not (b / "model.safetensors.index.json").exists()


def test_mxfp4_with_foreign_bytes_exits_2(tmp_path, tiny_ckpt):
    """An MXFP4 expert that is not a fixed point (a scale one binade too large) fails verification."""
    from kimi_core.checkpoint.tiny import tiny_config, tiny_state_dict

    cfg = tiny_config("k3")
    sd = tiny_state_dict(cfg, "mxfp4")
    k = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    sd[k] = sd[k] & 0x33  # only magnitudes <= 1.5: the group max no longer codes to the top of the grid
    write_checkpoint(str(tmp_path / "A"), sd, cfg)
    r = _run("dequantize", "--input", str(tmp_path / "A"), "--output", str(tmp_path / "B"))
    assert r.returncode == 2 and "experts.3.w2" in r.stderr


def test_resume_skips_finished_shards(tmp_path, tiny_ckpt):
    """A second run skips finished shards and says they were not re-verified."""
    b = tmp_path / "B"
    assert _run("dequantize", "--input", tiny_ckpt("k2"), "--output", str(b)).returncode == 0
    r = _run("dequantize", "--input", tiny_ckpt("k2"), "--output", str(b))
    assert r.returncode == 0 and "NOT re-verified" in r.stdout


_MEM_SCRIPT = r"""
import json, sys, threading, time
import torch, safetensors, tqdm  # imports are part of the baseline
from kimi_core.checkpoint.dequantize import dequantize_checkpoint

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

base, peak, done = rss(), [0], [False]
def sample():  # current RSS, sampled every 2 ms (ru_maxrss would include import-time transients)
    while not done[0]:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
dequantize_checkpoint(sys.argv[1], sys.argv[2], progress=False)
done[0] = True; t.join()
print(json.dumps({"base": base, "peak": peak[0]}))
"""


@pytest.mark.slow
def test_dequantize_peak_memory_under_twice_largest_shard(tmp_path):
    """Peak RSS growth while dequantizing a 4-shard INT4 checkpoint stays under 2x the largest shard."""
    from kimi_core.checkpoint.tiny import tiny_config

    cfg = tiny_config("k2")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(32):  # 32 experts x 3 x [1024, 2048] INT4 = ~100 MB packed
        for p in ("gate_proj", "up_proj", "down_proj"):
            w = torch.randn(1024, 2048, generator=g).to(torch.bfloat16)
            tensors.update({f"model.layers.1.mlp.experts.{e}.{p}.{k}": v for k, v in int4.quantize(w).items()})
    write_checkpoint(str(tmp_path / "A"), tensors, cfg, max_shard_bytes=30 * 2**20)
    shards = [f for f in os.listdir(tmp_path / "A") if f.endswith(".safetensors")]
    largest = max(os.path.getsize(tmp_path / "A" / f) for f in shards)
    assert len(shards) >= 3
    out = subprocess.run(
        [sys.executable, "-c", _MEM_SCRIPT, str(tmp_path / "A"), str(tmp_path / "B")],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(
        f"largest shard {largest / 2**20:.1f} MiB, peak RSS growth {growth / 2**20:.1f} MiB "
        f"({growth / largest:.2f}x); output is {4 * 1.0:.0f}x larger than the input"
    )
    assert growth < 2 * largest
