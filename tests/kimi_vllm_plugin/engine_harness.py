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
#: token ids of the bf16 checks: 8 fixed prompts x 40 tokens (312 scored positions), so the median is not
#: decided by the few positions where a bf16 top-k flip of the tiny random router lands
BF16_PROMPTS = torch.randint(3, 1024, (8, 40), generator=torch.Generator().manual_seed(22)).tolist()
#: bf16 bar: the engine's median |d logprob| vs float64 at most this times bf16's own (kimi_core.reference
#: run in bf16 on the same tokens, in the same run), plus BF16_SLACK for medians near zero
BF16_RATIO, BF16_SLACK = 1.5, 1e-3


def run_engine(
    tmp,
    ckpt: str,
    dtype: str,
    enable_lora: bool,
    steps: list[dict],
    engine_kwargs=None,
    plugins: str = "kimi",
    env: dict | None = None,
    prompts: list[list[int]] | None = None,
):
    """Start one engine on ``ckpt`` through the plugin, run ``steps``; returns ``(result, {tag: step})``.

    ``plugins`` is ``VLLM_PLUGINS`` (``"none"``: stock vLLM, no plugin); ``result["log"]`` holds the
    engine's stderr (vLLM's log), for tests that assert which kernels ran.
    """
    return finish_engine(start_engine(tmp, ckpt, dtype, enable_lora, steps, engine_kwargs, plugins, env, prompts))


def start_engine(
    tmp,
    ckpt: str,
    dtype: str,
    enable_lora: bool,
    steps: list[dict],
    engine_kwargs=None,
    plugins: str = "kimi",
    env: dict | None = None,
    prompts: list[list[int]] | None = None,
) -> dict:
    """:func:`run_engine`'s engine started and not waited for (its log goes to ``tmp/engine.log``): a module with
    two independent engines starts both, then :func:`finish_engine` each, so one engine's single-threaded start
    (imports, model build) runs beside the other's on a second core. Each engine is its own process with its own
    plan, exactly as :func:`run_engine` runs it alone."""
    plan = {
        "ckpt": ckpt,
        "max_lora_rank": MAX_LORA_RANK,
        "enable_lora": enable_lora,
        "prompts": prompts or PROMPTS,
        "stage_dir": str(tmp / "stage"),
        "steps": steps,
        "dtype": dtype,
        "engine_kwargs": engine_kwargs or {},
    }
    pp, out, log = tmp / "plan.json", tmp / "result.json", tmp / "engine.log"
    pp.write_text(json.dumps(plan))
    # model_info ships a function to the worker (LLM.apply_model), which vLLM only unpickles with this set
    env = dict(os.environ, VLLM_PLUGINS=plugins, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))
    with open(log, "w") as f:  # a file, not a pipe: an engine left waiting never blocks on a full pipe
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_script.py"), str(pp), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
    return {"proc": proc, "out": out, "log": log, "ckpt": ckpt, "dtype": dtype}


def finish_engine(started: dict, timeout: float = 900):
    """Wait for an engine of :func:`start_engine`; returns ``(result, {tag: step})`` as :func:`run_engine` does."""
    proc, out = started["proc"], started["out"]
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    log = started["log"].read_text()
    assert proc.returncode == 0 and out.exists(), f"engine failed:\n{log[-10000:]}"
    res = json.loads(out.read_text())
    res["log"] = log
    print(
        f"[{os.path.basename(started['ckpt'])} {started['dtype']}] engine start {res['start_s']:.1f}s, "
        f"first generate {res['first_generate_s']:.1f}s"
    )
    return res, {s.get("tag") or s["kind"]: s for s in res["steps"]}


def stop_engine(started: dict) -> None:
    """Kill an engine of :func:`start_engine` that no test waited for (a module fixture's teardown)."""
    if started["proc"].poll() is None:
        started["proc"].kill()
        started["proc"].wait()


def selected_tests(request, module: str | None = None) -> set[str]:
    """Names (parameters stripped) of the tests of ``request``'s module (or of the module file ``module`` in the same
    folder) that this session runs (after ``-k``, ``-m`` and deselection): a module fixture starts only the engines
    a selected test reads."""
    path = request.node.path if module is None else request.node.path.parent / module
    return {i.originalname for i in request.session.items if i.path == path}


def base_and_ab_steps(ckpt: str, tmp) -> tuple[dict, list[dict]]:
    """Write the test adapters of ``ckpt`` under ``tmp/adapters``; returns ``(paths by name, steps)``: the
    base scored, then adapter ``A`` (per-expert) and ``B`` (shared-outer) each loaded and scored."""
    from kimi_core.config import load_config

    ads = write_all(load_config(ckpt), str(tmp / "adapters"))
    steps = [{"kind": "base"}]
    for tag in ("A", "B"):
        steps += [{"kind": "load", "path": ads[tag], "tag": f"load_{tag}"}, {"kind": "score", "tag": tag}]
    return ads, steps


def reference_scorer(ckpt: str, dtype: torch.dtype = torch.float64):
    """``lps(prompt, adapter=None) -> [T-1]`` float64 prompt logprobs of ``kimi_core.reference`` on ``ckpt``,
    the model run in ``dtype``."""
    from kimi_core.reference import load_reference_model

    m = load_reference_model(ckpt, dtype=dtype)

    def lps(prompt, adapter=None):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            return m.logprobs(ids[:, :-1], ids[:, 1:], adapter=adapter)[0].double()

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
        print(
            f"{label} adapter {tag} max abs diff {d:.2e} (adapter shifts logprobs by up to "
            f"{(ref - base).abs().max():.2f})"
        )
        assert (ref - base).abs().max() > 0.1, "the adapter must matter"
        assert d < FP32_TOL


def check_base_bf16(res: dict, step: dict, ckpt: str, reference, label: str) -> None:
    """A bf16 engine (prompts :data:`BF16_PROMPTS`): its median |d logprob| vs the float64 ``reference`` over
    every position is at most ``BF16_RATIO`` x that of ``kimi_core.reference`` run in bf16 on the same tokens
    (+ ``BF16_SLACK``): the bar is bf16's own error, measured here, not a constant."""
    assert len(res["first_tokens"]) == 4
    b16 = reference_scorer(ckpt, torch.bfloat16)
    want = [reference(p) for p in BF16_PROMPTS]
    eng = torch.cat([torch.tensor(g, dtype=torch.float64) - w for g, w in zip(step["lps"], want)]).abs()
    own = torch.cat([b16(p) - w for p, w in zip(BF16_PROMPTS, want)]).abs()
    assert eng.numel() == own.numel() == sum(len(p) - 1 for p in BF16_PROMPTS)
    print(
        f"{label}: engine median {eng.median():.4f} mean {eng.mean():.4f} max {eng.max():.4f} | bf16 reference "
        f"median {own.median():.4f} mean {own.mean():.4f} max {own.max():.4f} ({eng.numel()} positions)"
    )
    assert eng.median() <= BF16_RATIO * own.median() + BF16_SLACK, (label, eng.median().item(), own.median().item())


#: test module of the K2.5 engine with SkyRL's own K2.5 patch in its worker (:func:`start_k25_skyrl_patch_engine`)
K25_SKYRL_PATCH_MODULE = "test_engine_k25_skyrl_patch_cpu.py"


def start_k25_skyrl_patch_engine(k25: str, patch: str, tmp) -> dict:
    """:func:`start_engine`'s dict, the adapter paths under ``"adapters"``, of :data:`K25_SKYRL_PATCH_MODULE`'s one
    fp32 text-only K2.5 engine, SkyRL's patch file ``patch`` applied in its worker by
    ``skyrl_k25_patch.SkyRLK25PatchExtension``; model info, then the base and adapters A / B
    (:func:`base_and_ab_steps`). Started by that module, or ahead by ``test_engine_k25_cpu.py``'s
    fixture beside its own two engines (``started_ahead``); the same process and plan either way."""
    from skyrl_k25_patch import PATCH_ENV

    ads, steps = base_and_ab_steps(k25, tmp)
    pythonpath = os.pathsep.join(p for p in (os.path.abspath(HERE), os.environ.get("PYTHONPATH")) if p)
    started = start_engine(
        tmp,
        k25,
        "float32",
        True,
        [{"kind": "model_info", "tag": "info"}, *steps],
        {"language_model_only": True, "worker_extension_cls": "skyrl_k25_patch.SkyRLK25PatchExtension"},
        env={PATCH_ENV: patch, "PYTHONPATH": pythonpath},
    )
    started["adapters"] = ads
    return started
