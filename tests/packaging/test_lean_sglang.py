"""An SGLang rollout node's install (run in the SGLang lane): ``kimi-core`` + ``kimi-sglang-plugin`` wheels
built from this checkout, alone beside SGLang 0.5.23 (the third-party packages of the lane's venv, without any
of ours). The plugin imports, SGLang's own plugin loader runs it through the ``sglang.srt.plugins`` entry
point, and the siblings (Megatron plugin, vLLM plugin, glue) are not importable."""

from __future__ import annotations

import dist_tools
import pytest

pytest.importorskip("sglang", reason="the lean SGLang install reuses this venv's SGLang (the SGLang lane)")

CHECK = (
    dist_tools.LEAN_PROLOGUE
    + """
os.environ["SGLANG_PLUGINS"] = "kimi"
res["eps"] = sorted(f"{e.name} = {e.value} ({e.dist.name})" for e in md.entry_points(group="sglang.srt.plugins")
                    if e.name == "kimi" or e.dist.name.lower().startswith("kimi"))
from sglang.srt.plugins import load_plugins
load_plugins()
from kimi_sglang_plugin import registration
res["state"] = {k: (v if isinstance(v, (str, type(None))) else bool(v)) for k, v in registration._STATE.items()}
print(json.dumps(res))
"""
)


@pytest.fixture(scope="module")
def lean(built, tmp_path_factory):
    work = tmp_path_factory.mktemp("lean_sglang")
    py = dist_tools.lean_venv(work, [built("kimi-core")[1], built("kimi-sglang-plugin")[1]])
    return py, work


def test_only_the_two_members_are_installed(lean):
    """The lean venv holds kimi-core and kimi-sglang-plugin and nothing else of ours; the checkout is not on
    sys.path; every dependency they declare is met by what is installed."""
    py, work = lean
    res = dist_tools.run_in(py, dist_tools.LEAN_PROLOGUE + "print(json.dumps(res))", work)
    assert res["ours"] == ["kimi-core", "kimi-sglang-plugin"]
    assert res["root_on_path"] == []
    missing = dist_tools.requirement_report(py, ["kimi-core", "kimi-sglang-plugin"], {}, work)
    assert missing == {"kimi-core": [], "kimi-sglang-plugin": []}, missing


def test_plugin_loads_through_the_entry_point_and_siblings_are_absent(lean):
    """SGLang's ``load_plugins()`` finds ``kimi`` in ``sglang.srt.plugins`` and runs ``register()`` from the
    lean venv (hooks, config and models registered, nothing refused); the siblings raise ModuleNotFoundError."""
    py, work = lean
    res = dist_tools.run_in(py, CHECK, work)
    imp = res["imports"]
    for m in ("kimi_core", "kimi_sglang_plugin"):
        assert imp[m].startswith(str(work / "venv")), (m, imp[m])
    for m in ("kimi_megatron_plugin", "kimi_vllm_plugin", "kimi_rl_glue"):
        assert imp[m] == f"ModuleNotFoundError: {m}", (m, imp[m])
    assert res["eps"] == ["kimi = kimi_sglang_plugin:register (kimi-sglang-plugin)"]
    state = res["state"]
    assert all(state[k] for k in ("hooks", "config", "models")) and state["refused"] is None, state
