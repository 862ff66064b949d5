"""A driver node's minimal install: ``kimi-core`` + ``kimi-rl-glue`` wheels built from this checkout, no plugin.
The ``kimi-rl`` console script is installed and runs (``--help``, ``make-tiny``, ``doctor``), every dependency
the glue declares is met, and no plugin is importable: the glue needs a plugin only for what uses it."""

from __future__ import annotations

import subprocess

import dist_tools
import pytest


@pytest.fixture(scope="module")
def lean(built, tmp_path_factory):
    work = tmp_path_factory.mktemp("lean_glue")
    py = dist_tools.lean_venv(work, [built("kimi-core")[1], built("kimi-rl-glue")[1]])
    return py, work


def test_glue_alone_runs_its_cli_without_any_plugin(lean):
    """``kimi-rl make-tiny`` and ``kimi-rl doctor`` work with only kimi-core and the glue installed; the plugins
    raise ModuleNotFoundError there."""
    py, work = lean
    res = dist_tools.run_in(py, dist_tools.LEAN_PROLOGUE + "print(json.dumps(res))", work)
    assert res["ours"] == ["kimi-core", "kimi-rl-glue"] and res["root_on_path"] == []
    for m in ("kimi_megatron_plugin", "kimi_vllm_plugin", "kimi_sglang_plugin"):
        assert res["imports"][m] == f"ModuleNotFoundError: {m}", (m, res["imports"][m])
    assert dist_tools.requirement_report(py, ["kimi-core", "kimi-rl-glue"], {}, work) == {
        "kimi-core": [],
        "kimi-rl-glue": [],
    }
    cli = str(py.parent / "kimi-rl")
    for args in (["--help"], ["make-tiny", "--model", "k2", "--out", str(work / "tiny")], ["doctor"]):
        r = subprocess.run(
            [cli, *args], cwd=work, capture_output=True, text=True, timeout=300, env=dist_tools.clean_env()
        )
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-3000:])
    assert (work / "tiny" / "config.json").is_file()
