"""``tools/gpu/skyrl_loop_check.py`` reads SkyRL's own console log format: the log lines here are written by
skyrl 0.4.0's ``ConsoleLogger`` (through loguru, as in a run), with our worker's and vLLM's lines around them."""

from __future__ import annotations

import importlib.util
import io
import os

from py312_lane import require

require("skyrl", "skyrl==0.4.0")
from loguru import logger
from skyrl.train.utils.tracking import ConsoleLogger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _checker():
    spec = importlib.util.spec_from_file_location(
        "skyrl_loop_check", os.path.join(ROOT, "tools/gpu/skyrl_loop_check.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _skyrl_log(steps: dict[int, dict]) -> str:
    buf = io.StringIO()
    sink = logger.add(buf, format="{time} | {level} | {message}")
    try:
        for step, data in steps.items():
            ConsoleLogger().log(data, step)
    finally:
        logger.remove(sink)
    return buf.getvalue()


def test_checker_reads_skyrls_console_log():
    check = _checker()
    steps = {
        s: {
            "reward/avg_raw_reward": 0.1 * s,
            "policy/rollout_train_logprobs_abs_diff_mean": 0.0123,
            "timing/step": 3.5,
        }
        for s in (1, 2, 3)
    }
    ours = "\n".join(
        [
            "[kimi-skyrl-worker] bridge KimiK2TextBridge, experts w4a16",
            "[kimi-skyrl-worker] LoRA rank 32 (experts 4), 10 dense modules, 2 expert groups, 123 parameters",
            "INFO kimi_vllm_plugin: building DeepseekV3LoRAForCausalLM (vLLM's fused MoE)",
            "INFO Using CompressedTensorsWNA16MarlinMoEMethod",
            "INFO Using fused MoE LoRA implementation",
        ]
        + [
            f"[kimi-skyrl-worker] adapter synced: 40 tensors -> /tmp/s as 'skyrl-lora', prefix cache reset True, "
            f"sync_s 0.{s}00"
            for s in (1, 2, 3)
        ]
        + ["INFO kimi_vllm_plugin: LoRA 'skyrl-lora' from /tmp/s served in its prepared form"]
    )
    summary, fails = check.check(ours + "\n" + _skyrl_log(steps), {"reference_bf16_vs_fp32_mean": 0.01}, 3)
    assert fails == [], fails
    assert summary["steps_logged"] == [1, 2, 3]
    assert summary["reward_per_step"] == {1: 0.1, 2: 0.2, 3: 0.3}
    assert summary["sync_s"] == [0.1, 0.2, 0.3] and summary["expert_mode"] == "w4a16"
    assert summary["step0_rollout_train_logprobs_abs_diff_mean"] == 0.0123
    # above twice the floor: named
    _, fails = check.check(ours + "\n" + _skyrl_log(steps), {"reference_bf16_vs_fp32_mean": 0.005}, 3)
    assert any("bf16 floor" in f for f in fails)
    # nothing of ours in the log: every marker is named
    _, fails = check.check(_skyrl_log(steps), None, 3)
    assert {f for f in fails if f.startswith("missing:")} == {f"missing: {k}" for k in check.MARKERS}
