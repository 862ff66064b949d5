"""Fixtures of the SGLang plugin tests. They run in the lean SGLang venv (``make test-sglang``);
where SGLang is not importable (the main venv) the whole folder is skipped at collection. This
folder's helpers (``source_facts``, ``sglang_engine_harness``) are importable by name."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py", "models/test_*.py"]


@pytest.fixture(scope="session")
def plugin():
    """SGLang with the plugin registered (imports SGLang once per session: ~20 s idle, more under load)."""
    from kimi_sglang_plugin import register

    register()
    import kimi_sglang_plugin.registration as reg

    assert reg._STATE["refused"] is None, reg._STATE["refused"]
    return reg


@pytest.fixture(scope="session")
def k31_config(tiny_ckpt):
    """``KimiConfig`` of the tiny K3.1 checkpoint."""
    from kimi_core.config import load_config

    return load_config(tiny_ckpt("k31"))
