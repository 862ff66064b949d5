"""Read the log of ``tools/gpu/skyrl_loop.sh`` and check, from the hosts' own output, what ran.

Usage: ``python3 tools/gpu/skyrl_loop_check.py LOOP_LOG [--floor FLOOR_JSON] [--json OUT]``; exit 1 when a check
fails. Checks, each by a line SkyRL, vLLM or our plugins printed:

* SkyRL's trainer logged its per-step metrics (``Step N:`` dicts of its console logger) for every step, with a
  reward computed by the generator's environment (``reward/avg_raw_reward``);
* our Megatron worker built the Kimi model (``[kimi-skyrl-worker] bridge Kimi...``) and synced the adapter each
  step (``adapter synced``, with its ``sync_s``);
* vLLM ran Marlin WNA16 MoE and the fused MoE LoRA, and served the adapter through our plugin
  (``kimi_vllm_plugin: LoRA ... served in its prepared form``);
* step 0's ``policy/rollout_train_logprobs_abs_diff_mean`` is within 2x the bf16 floor of ``FLOOR_JSON``
  (``tools/gpu/skyrl_floor.py``: the reference in bf16 against fp32 on the same tokens).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys

STEP = re.compile(r"Step (\d+): \n?(\{.*?\})\s*$", re.S | re.M)
SYNC = re.compile(r"\[kimi-skyrl-worker\] adapter synced: (\d+) tensors .* sync_s ([0-9.]+)")
MARKERS = {
    "worker_built_kimi_model": r"\[kimi-skyrl-worker\] bridge Kimi\w+Bridge, experts (\w+)",
    "worker_lora": r"\[kimi-skyrl-worker\] LoRA rank \d+",
    "vllm_built_kimi_class": r"kimi_vllm_plugin: building \w+ \(vLLM's fused MoE\)",
    "vllm_marlin_wna16_moe": r"Using CompressedTensorsWNA16MarlinMoEMethod",
    "vllm_fused_moe_lora": r"Using fused MoE LoRA implementation",
    "vllm_plugin_served_adapter": r"kimi_vllm_plugin: LoRA '[^']+' from \S+ served in its prepared form",
}
#: step 0's trainer-vs-engine mean |dlogprob| may be this many times the bf16 floor: two bf16 engines (the
#: trainer's and vLLM's) each sit about one floor away from the fp32 reference
FLOOR_FACTOR = 2.0


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def steps_of(log: str) -> dict[int, dict]:
    """``{step: metrics}`` from SkyRL's console logger (``pprint`` of a dict whose floats are strings)."""
    out = {}
    for m in STEP.finditer(log):
        try:
            d = ast.literal_eval(m.group(2))
        except (SyntaxError, ValueError):
            continue
        out[int(m.group(1))] = {k: _num(v) for k, v in d.items()}
    return out


def check(log: str, floor: dict | None, want_steps: int) -> tuple[dict, list[str]]:
    steps = steps_of(log)
    found = {k: bool(re.search(p, log)) for k, p in MARKERS.items()}
    mode = re.search(MARKERS["worker_built_kimi_model"], log)
    syncs = [(int(n), float(s)) for n, s in SYNC.findall(log)]
    rewards = {s: m.get("reward/avg_raw_reward") for s, m in sorted(steps.items())}
    first = steps[min(steps)] if steps else {}
    diff0 = first.get("policy/rollout_train_logprobs_abs_diff_mean")
    summary = {
        "steps_logged": sorted(steps),
        "reward_per_step": rewards,
        "sync_s": [s for _, s in syncs],
        "adapter_tensors": syncs[0][0] if syncs else None,
        "expert_mode": mode.group(1) if mode else None,
        "step0_rollout_train_logprobs_abs_diff_mean": diff0,
        "floor": floor,
        "markers": found,
    }
    fails = [f"missing: {k}" for k, ok in found.items() if not ok]
    if len(steps) < want_steps:
        fails.append(f"SkyRL logged {len(steps)} steps, wanted {want_steps}")
    if any(r is None for r in rewards.values()):
        fails.append("a step without reward/avg_raw_reward")
    if len(syncs) < want_steps:
        fails.append(f"{len(syncs)} adapter syncs for {want_steps} steps")
    if floor and isinstance(diff0, float):
        bar = FLOOR_FACTOR * floor["reference_bf16_vs_fp32_mean"]
        summary["step0_bar"] = bar
        if diff0 > bar:
            fails.append(f"step 0 trainer vs vLLM {diff0:.4f} > {FLOOR_FACTOR} x bf16 floor = {bar:.4f}")
    elif floor:
        fails.append("no step-0 policy/rollout_train_logprobs_abs_diff_mean in SkyRL's metrics")
    return summary, fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--floor", default=None, help="floor.json of tools/gpu/skyrl_floor.py")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    log = open(a.log, errors="replace").read()
    floor = None
    if a.floor:
        try:
            floor = json.load(open(a.floor))
        except OSError:
            floor = None
    summary, fails = check(log, floor, a.steps)
    summary["failures"] = fails
    text = json.dumps(summary, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
