"""What every engine test module shares: run ``engine_script.py`` in a subprocess, compare with the reference.

One engine start per call of :func:`run_engine` (30-180 s on 2 shared cores), so each test module
runs it once in a module-scoped fixture and every test reads the recorded JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from vllm_adapters import MAX_LORA_RANK, write_all

HERE = os.path.dirname(__file__)
#: token ids scored by every engine test (vocab 1024 in the tiny checkpoints)
PROMPTS = [[5, 17, 99, 3, 250, 511, 42, 7, 900, 13, 64, 128], [1, 2, 3, 4, 1000, 77, 31]]
#: fp32 engine vs float64 reference, max abs prompt-logprob difference (measured <= 4.1e-6)
FP32_TOL = 1e-4
#: bf16 engine vs float64 reference (measured 0.028 on the K2 checkpoint: bf16 activations and
#: bf16-rounded dequantized INT4 experts; a stock bf16 DeepSeek-V3 engine was within 0.006)
BF16_TOL = 0.06


def run_engine(tmp, ckpt: str, dtype: str, enable_lora: bool, steps: list[dict], engine_kwargs=None,
               plugins: str = "kimi", env: dict | None = None, prompts: list[list[int]] | None = None):
    """Start one engine on ``ckpt`` through the plugin, run ``steps``; returns ``(result, {tag: step})``.

    ``plugins`` is ``VLLM_PLUGINS`` (``"none"``: stock vLLM, no plugin); ``result["log"]`` holds the
    engine's stderr (vLLM's log), for tests that assert which kernels ran.
    """
    plan = {"ckpt": ckpt, "max_lora_rank": MAX_LORA_RANK, "enable_lora": enable_lora, "prompts": prompts or PROMPTS,
            "stage_dir": str(tmp / "stage"), "steps": steps, "dtype": dtype, "engine_kwargs": engine_kwargs or {}}
    pp, out = tmp / "plan.json", tmp / "result.json"
    pp.write_text(json.dumps(plan))
    # model_info ships a function to the worker (LLM.apply_model), which vLLM only unpickles with this set
    env = dict(os.environ, VLLM_PLUGINS=plugins, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))
    r = subprocess.run([sys.executable, os.path.join(HERE, "engine_script.py"), str(pp), str(out)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and out.exists(), f"engine failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    res = json.loads(out.read_text())
    res["log"] = r.stderr + r.stdout
    print(f"[{os.path.basename(ckpt)} {dtype}] engine start {res['start_s']:.1f}s, "
          f"first generate {res['first_generate_s']:.1f}s")
    return res, {s.get("tag") or s["kind"]: s for s in res["steps"]}


def base_and_ab_steps(ckpt: str, tmp) -> tuple[dict, list[dict]]:
    """Write the test adapters of ``ckpt`` under ``tmp/adapters``; returns ``(paths by name, steps)``: the
    base scored, then adapter ``A`` (per-expert) and ``B`` (shared-outer) each loaded and scored."""
    from kimi_core.config import load_config

    ads = write_all(load_config(ckpt), str(tmp / "adapters"))
    steps = [{"kind": "base"}]
    for tag in ("A", "B"):
        steps += [{"kind": "load", "path": ads[tag], "tag": f"load_{tag}"}, {"kind": "score", "tag": tag}]
    return ads, steps


def reference_scorer(ckpt: str):
    """``lps(prompt, adapter=None) -> [T-1]`` float64 prompt logprobs of ``kimi_core.reference`` on ``ckpt``."""
    from kimi_core.reference import load_reference_model

    m = load_reference_model(ckpt, dtype=torch.float64)

    def lps(prompt, adapter=None):
        ids = torch.tensor([prompt])
        return m.logprobs(ids[:, :-1], ids[:, 1:], adapter=adapter)[0]

    return lps


def maxdiff(got, ref) -> float:
    """Max abs difference of engine logprobs ``got`` (list) and reference ``ref`` (tensor)."""
    return (torch.tensor(got, dtype=torch.float64) - ref).abs().max().item()


def check_base(res: dict, step: dict, reference, label: str, tol: float = FP32_TOL) -> None:
    """The engine generated 4 tokens and every prompt's logprobs are within ``tol`` of the reference."""
    assert len(res["first_tokens"]) == 4
    for p, got in zip(PROMPTS, step["lps"]):
        d = maxdiff(got, reference(p))
        print(f"{label} base max abs diff {d:.2e}")
        assert d < tol


def check_adapter(steps: dict, ads: dict, reference, tag: str, label: str) -> None:
    """Adapter ``tag`` loaded and each prompt's logprobs equal the reference with that adapter (fp32)."""
    assert steps[f"load_{tag}"]["ok"], steps[f"load_{tag}"]
    for p, got in zip(PROMPTS, steps[tag]["lps"][:2]):
        ref, base = reference(p, ads[tag]), reference(p)
        d = maxdiff(got, ref)
        print(f"{label} adapter {tag} max abs diff {d:.2e} (adapter shifts logprobs by up to "
              f"{(ref - base).abs().max():.2f})")
        assert (ref - base).abs().max() > 0.1, "the adapter must matter"
        assert d < FP32_TOL
