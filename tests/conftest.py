"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `from utils import assert_close`


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(model, quant=None, convention='kimi', seed=0, layers=None) -> path``, cached per session."""
    from kimi_core.checkpoint.tiny import make_tiny

    cache: dict = {}

    def make(model: str, quant=None, convention="kimi", seed=0, layers=None) -> str:
        key = (model, quant, convention, seed, layers)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{model}_{quant}_{convention}_{seed}_{layers}")
            cache[key] = make_tiny(model, d, quant=quant, convention=convention, seed=seed, layers=layers)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def mcore_world():
    """megatron-core model-parallel state for this one CPU process (gloo, TP = PP = EP = 1)."""
    import socket

    from kimi_megatron_plugin import cpu_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpu_parallel.initialize_cpu_parallel(1, 1, 1, rank=0, world_size=1, port=port)
    yield
    cpu_parallel.destroy_cpu_parallel()


@pytest.fixture(scope="session")
def started_ahead():
    """``{name: started}``: processes a module fixture started for a LATER module's tests (each a dict holding its
    ``subprocess.Popen`` as ``"proc"``), so its single-threaded start runs beside the first module's work on the
    second core; the later module pops its entry, or starts its own when the first module did not run. Processes
    no test waited for are killed at the session's end."""
    ahead: dict[str, dict] = {}
    yield ahead
    for started in ahead.values():
        if started["proc"].poll() is None:
            started["proc"].kill()
            started["proc"].wait()
