"""``kimi-rl demo --recipe skyrl-k2 --device cuda --size small`` on one GPU (``-m gpu``, the H200 with vLLM
0.26.0 and megatron-core 0.19.2; ``bash tests/gpu/h200_session.sh skyrl_demo``): seed 003's loop with every real
part on the GPU. The GPU vLLM serves the small K2.x INT4 checkpoint through ``kimi_vllm_plugin`` (Marlin WNA16
MoE, fused MoE LoRA, both read from vLLM's own log so a CPU fallback cannot pass), the Megatron trainer trains
on the same GPU from verified BF16 masters with fake-INT4 QAT experts and capacity-normalised expert LoRA,
GRPO + token TIS, the adapter hot-loaded from disk each step. Asserts the reward rise and the step-0 bound.
``$KIMI_TEST_OUT`` (when set) receives the run's log, summary and metrics for ``benchmarks/RESULTS.md``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

#: what vLLM 0.26's log says when the GPU path of a LoRA-enabled INT4 K2 engine runs
GPU_PATH_LINES = ("CompressedTensorsWNA16MarlinMoEMethod", "Using fused MoE LoRA implementation", "PunicaWrapperGPU")


def test_skyrl_recipe_on_one_gpu(tmp_path):
    steps = int(os.environ.get("KIMI_SKYRL_STEPS", "20"))
    out = tmp_path / "skyrl"
    cmd = [sys.executable, "-m", "kimi_rl_glue.cli", "demo", "--recipe", "skyrl-k2", "--device", "cuda", "--size",
           "small", "--steps", str(steps), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("KIMI_SKYRL_TIMEOUT", "900")))
    log = r.stdout + r.stderr
    keep = os.environ.get("KIMI_TEST_OUT")
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, "skyrl_demo_gpu.log"), "w") as f:
            f.write(log)
        for name in ("summary.json", "metrics.jsonl", "reward.png"):
            if (out / name).exists():
                shutil.copy(out / name, os.path.join(keep, f"skyrl_demo_gpu_{name}"))
    assert r.returncode == 0, log[-6000:]
    missing = [line for line in GPU_PATH_LINES if line not in log]
    assert not missing, f"vLLM's log lacks {missing}: the GPU path did not run"
    assert "[setup] trainer: megatron (qat experts) on cuda" in r.stdout, r.stdout[-3000:]
    s = json.load(open(out / "summary.json"))
    print(json.dumps(s, indent=1))
    assert (s["recipe"], s["device"], s["size"], s["expert_mode"]) == ("skyrl-k2", "cuda", "small", "qat"), s
    assert s["step0_logprob_abs_diff_median"] <= 1.5 * s["step0_bf16_floor_median"], s
    assert s["last_20pct_reward"] > s["first_20pct_reward"] + 0.03, s
