"""One ``kimi-rl demo --device cuda --size small`` run for the GPU demo tests (``tests/kimi_rl_glue/test_demo_gpu.py``:
skyrl-k2 and miles-k3): runs the CLI in a subprocess, keeps its log, summary, metrics and reward plot in
``$KIMI_TEST_OUT`` (when set: ``tools/gpu/session.sh`` brings them back for ``docs/performance.md#demo-loops``), and
asserts what every recipe must show: exit 0, the engine's own log lines of its GPU path (so a fallback cannot pass),
the trainer on cuda, the recipe's summary fields, the step-0 train/rollout mismatch within 1.5x the bf16 floor and
the reward rise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


def run_demo_on_gpu(
    recipe: str, out, tag: str, gpu_path_lines: tuple[str, ...], expert_mode: str, default_steps: int = 20
) -> dict:
    """``tag``: file prefix in ``$KIMI_TEST_OUT`` and the environment's ``KIMI_<TAG>_STEPS`` / ``_TIMEOUT``."""
    env = tag.split("_")[0].upper()
    steps = int(os.environ.get(f"KIMI_{env}_STEPS", str(default_steps)))
    cmd = [
        sys.executable,
        "-m",
        "kimi_rl_glue.cli",
        "demo",
        "--recipe",
        recipe,
        "--device",
        "cuda",
        "--size",
        "small",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--verbose",  # the engines' own output stays on the terminal: the GPU-path lines are read from it
    ]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=int(os.environ.get(f"KIMI_{env}_TIMEOUT", "900"))
        )
        log, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:  # keep what it printed, so a run cut short still says where it was
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        log, rc = text(e.stdout) + text(e.stderr) + f"\n[timed out after {e.timeout} s]", None
    keep = os.environ.get("KIMI_TEST_OUT")
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, f"{tag}.log"), "w") as f:
            f.write(log)
        for name in ("summary.json", "metrics.jsonl", "reward.png"):
            if os.path.exists(os.path.join(out, name)):
                shutil.copy(os.path.join(out, name), os.path.join(keep, f"{tag}_{name}"))
    assert rc == 0, log[-6000:]
    missing = [line for line in gpu_path_lines if line not in log]
    assert not missing, f"the engine's log lacks {missing}: its GPU path did not run"
    assert f"[setup] trainer: megatron ({expert_mode} experts) on cuda" in r.stdout, r.stdout[-3000:]
    s = json.load(open(os.path.join(out, "summary.json")))
    print(json.dumps(s, indent=1))
    assert (s["recipe"], s["device"], s["size"], s["expert_mode"]) == (recipe, "cuda", "small", expert_mode), s
    assert s["step0_logprob_abs_diff_median"] <= 1.5 * s["step0_bf16_floor_median"], s
    assert s["last_20pct_reward"] > s["first_20pct_reward"] + 0.03, s
    return s
