"""`kimi-rl check-numerics`: identical models agree exactly, broken models are caught at their layer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from utils import perturb_expert_scales

from kimi_rl_glue.numerics import compare


def test_identical_checkpoints_agree_exactly(tiny_ckpt, tmp_path):
    """The fp32 reference against itself on a copied checkpoint gives zero difference and full top-1 agreement."""
    d = str(tmp_path / "copy")
    shutil.copytree(tiny_ckpt("k2"), d)
    rep = compare(
        tiny_ckpt("k2"),
        engines=["reference", f"reference@{d}"],
        tokens=8,
        dtype="fp32",
        batch=1,
        prompt_len=8,
        out=str(tmp_path / "out"),
    )
    (p,) = rep.pairs
    assert p.max_abs == 0.0 and p.kl == 0.0 and p.top1_agree == 1.0 and not p.flagged
    data = json.load(open(tmp_path / "out" / "report.json"))
    assert data["pairs"][0]["max_abs"] == 0.0
    assert os.path.getsize(tmp_path / "out" / "logprob_diff.png") > 1000


def test_perturbed_expert_scale_is_flagged_at_its_layer(tiny_ckpt, tmp_path):
    """Scaling layer 2's expert scales is flagged, and the first diverging layer named is layer 2."""
    d = str(tmp_path / "bad")
    perturb_expert_scales(tiny_ckpt("k2"), d, layer=2, factor=1.5)
    rep = compare(
        tiny_ckpt("k2"), engines=["reference", f"reference@{d}"], tokens=8, dtype="fp32", batch=1, prompt_len=8
    )
    (p,) = rep.pairs
    assert p.flagged
    assert p.first_diverging_layer == 3  # hidden[0] = embeddings, hidden[3] = after layer 2
    assert all(e == 0.0 for e in p.layer_errors[:3])
    assert "layer 2" in rep.table() and "FLAGGED" in rep.table()


def test_missing_engines_are_listed_with_install_hint(tiny_ckpt, monkeypatch):
    """An engine whose host is not installed is reported as skipped with how to install it; every listed
    engine's module exists (no engine is listed that cannot run); an unknown name is an error."""
    import importlib.util

    from kimi_rl_glue.numerics.engines import ENGINES, ModuleEngine

    for eng in ENGINES.values():
        if isinstance(eng, ModuleEngine):
            assert importlib.util.find_spec(eng.engine_module) is not None, eng.engine_module
    absent = ModuleEngine(
        "absent", "no_such_host_pkg", "kimi_core", "kimi_rl_glue.numerics.vllm_engine", 'pip install "no-such-host"'
    )
    monkeypatch.setitem(ENGINES, "absent", absent)
    rep = compare(tiny_ckpt("k2"), engines=["reference", "absent"], tokens=4, dtype="fp32", batch=1, prompt_len=4)
    assert "pip install" in rep.skipped["absent"] and "no_such_host_pkg" in rep.skipped["absent"]
    with pytest.raises(ValueError, match="unknown engine"):
        compare(tiny_ckpt("k2"), engines=["nonsense"], tokens=2, batch=1, prompt_len=2)


def test_png_is_optional_without_matplotlib(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """Without matplotlib the report is still written, the PNG is skipped and one warning says what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "rep"
    with caplog.at_level("WARNING", logger="kimi_rl_glue.plotting"):
        compare(
            tiny_ckpt("k2"),
            engines=["reference", "reference"],
            tokens=2,
            dtype="fp32",
            batch=1,
            prompt_len=4,
            out=str(out),
        )
    assert (out / "report.json").exists() and not (out / "logprob_diff.png").exists()
    assert "pip install matplotlib" in caplog.text and "logprob_diff.png" in caplog.text
