"""The tiny CPU versions of the recipes in examples/local/ run end to end with their shortest settings.

All three run at once (two cores), each in its own temporary output folder; every test then checks
one script's output: the steps that run on a CPU ran, and the GPU command was printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "k3": "examples/local/run_kimi_k3_lora_tiny.sh",
    "k31": "examples/local/run_kimi_k31_w4a16_lora_tiny.sh",
    "k2": "examples/local/run_kimi_k2_int4_qat_lora_tiny.sh",
}
SHORTEST = {"LAYERS": "2", "TOKENS": "2", "DEMO_STEPS": "0", "SHOW_RTN": "0"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (returncode, output, seconds)}`` for every local script, run concurrently."""
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "ENGINES", "KIMI_RL", "DRY_RUN")}
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    procs = {}
    for name, script in SCRIPTS.items():
        out = tmp_path_factory.mktemp(name)
        procs[name] = (
            subprocess.Popen(
                ["bash", str(REPO / script)],
                env={**env, **SHORTEST, "OUT": str(out)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            time.time(),
        )
    done = {}
    for name, (p, t0) in procs.items():
        text, _ = p.communicate(timeout=300)
        done[name] = (p.returncode, text, time.time() - t0)
    return done


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_local_script_runs_and_prints_the_cluster_command(runs, name):
    """Each local script exits 0, runs its CPU steps and prints the launch script's DRY_RUN command."""
    rc, text, seconds = runs[name]
    print(f"{SCRIPTS[name]}: {seconds:.1f} s")
    assert rc == 0, text[-3000:]
    assert "wrote tiny" in text or "(reusing" in text
    assert "dequantized" in text and "verified as fixed points" in text
    assert re.search(r"^reference-fp32 vs reference@", text, flags=re.M)
    assert "# command:" in text and "nothing was started" in text


@pytest.mark.parametrize("name", ["k3", "k31"])
def test_mxfp4_checkpoint_equals_its_bf16_copy(runs, name):
    """On K3/K3.1 the MXFP4 checkpoint and its BF16 copy give identical fp32 logprobs: the copy the seed made adds nothing."""
    _, text, _ = runs[name]
    row = next(ln for ln in text.splitlines() if ln.startswith("reference-fp32 vs reference@"))
    assert row.split()[3:5] == ["0.000e+00", "0.000e+00"], row
    assert "wrote 8 dapo-math rows" in text  # the sample prompts went through kimi-rl prepare-data


def test_k31_reports_mxfp4_bytes_per_parameter(runs):
    """The K3.1 smoke run reports the trainer's MXFP4 expert storage at about 0.53 bytes per parameter."""
    _, text, _ = runs["k31"]
    m = re.search(r"([0-9.]+) bytes per parameter", text)
    assert m and abs(float(m.group(1)) - 0.53125) < 1e-3, text[-2000:]
