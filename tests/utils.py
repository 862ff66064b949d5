"""Shared test helpers: one relative-error comparison used by every numeric test, checkpoint and config helpers, and
the loader of the benchmark scripts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

from kimi_core.reference.replay import rel_rms_error


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> float:
    """Assert the relative RMS error of ``got`` vs ``ref`` is at most ``ratio``; print the max abs diff.

    :returns: the measured relative error (so tests can report it).
    """
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values in result"
    err = rel_rms_error(ref, got)
    max_abs = (got.detach().double() - ref.detach().double()).abs().max().item() if ref.numel() else 0.0
    print(f"{name}: rel_rms={err:.3e} max_abs={max_abs:.3e} (tol {ratio:.1e})")
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs diff {max_abs:.3e})"
    return err


def perturb_expert_scales(src: str, dst: str, layer: int, factor: float) -> None:
    """Copy a tiny INT4 checkpoint, scaling every routed expert's down_proj scale of ``layer`` by ``factor``."""
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if not f.endswith(".safetensors"):
            continue
        sd = load_file(os.path.join(dst, f))
        hit = False
        for k in list(sd):
            if f"layers.{layer}.mlp.experts." in k and k.endswith("down_proj.weight_scale"):
                sd[k] = (sd[k].float() * factor).to(sd[k].dtype)
                hit = True
        if hit:
            save_file(sd, os.path.join(dst, f), metadata={"format": "pt"})


SKYRL_K2_SCRIPT = "examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh"


def skyrl_dry_run_overrides(script: str = SKYRL_K2_SCRIPT, **knobs) -> list[str]:
    """The SkyRL config overrides the example ``script`` would pass to ``skyrl.train.entrypoints.main_base``
    (its ``DRY_RUN=1`` output), with environment ``knobs`` set and EXPERT_WEIGHTS / QAT_MODE cleared."""
    import shlex
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("EXPERT_WEIGHTS", "QAT_MODE")}
    r = subprocess.run(
        ["bash", os.path.join(repo, script)],
        env={**env, "DRY_RUN": "1", **knobs},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    argv = shlex.split(lines[lines.index("# command:") + 1])
    i = next(i for i, t in enumerate(argv) if t.endswith("skyrl.train.entrypoints.main_base"))
    return argv[i + 1 :]


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` imported as a module (the benchmarks are scripts, not a package; their
    folder goes on ``sys.path`` for the helpers they import from beside them)."""
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    spec = importlib.util.spec_from_file_location(name, os.path.join(bench_dir, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
