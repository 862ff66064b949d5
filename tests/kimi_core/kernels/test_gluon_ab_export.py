"""``benchmarks/w4a16_gluon_ab.py export``: a revision's Gluon kernel modules copied beside the working tree's, their
imports of each other pointing at the copies (so a before / after timing runs the old pair against the new)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
from utils import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load_ab(monkeypatch, before_dir):
    module = load_benchmark("w4a16_gluon_ab")
    monkeypatch.setattr(module, "BEFORE", str(before_dir))
    return module


@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")),
                    reason="needs a git checkout")
def test_export_rewrites_the_pair_to_import_each_other(monkeypatch, tmp_path):
    ab = load_ab(monkeypatch, tmp_path / "before")
    ab.export("HEAD")
    files = sorted(os.listdir(tmp_path / "before"))
    assert files == ["before_gluon_w4a16.py", "before_gluon_w4a16_rs.py"]
    rs_text = (tmp_path / "before" / "before_gluon_w4a16_rs.py").read_text()
    assert "import before_gluon_w4a16 as ws" in rs_text
    assert "from kimi_core.kernels import gluon_w4a16 " not in rs_text
    head = subprocess.run(["git", "show", "HEAD:kimi_core/kernels/gluon_w4a16.py"], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout
    assert (tmp_path / "before" / "before_gluon_w4a16.py").read_text().endswith(head)
    monkeypatch.syspath_prepend(str(tmp_path / "before"))
    before_rs = importlib.import_module("before_gluon_w4a16_rs")
    assert before_rs.ws.__name__ == "before_gluon_w4a16"
    for name in ("before_gluon_w4a16_rs", "before_gluon_w4a16"):
        sys.modules.pop(name, None)


def test_run_without_an_export_names_the_command(monkeypatch, tmp_path):
    ab = load_ab(monkeypatch, tmp_path / "missing")
    with pytest.raises(SystemExit, match=r"w4a16_gluon_ab.py export REV"):
        ab.run([512], ["fwd"], ["mxfp4"], {})
