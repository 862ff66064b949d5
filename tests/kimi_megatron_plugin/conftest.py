"""Fixtures of the Megatron plugin tests: import paths and a one-process gloo world."""

from __future__ import annotations

import os
import socket
import sys

import pytest

_HERE = os.path.dirname(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for p in (
    _ROOT,
    _HERE,
    os.path.dirname(_HERE),
):  # package (even before `pip install -e .` picks it up), mp_worker, utils
    if p not in sys.path:
        sys.path.insert(0, p)

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[megatron]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore_world():
    """megatron-core model-parallel state for a single CPU process (TP = PP = EP = 1)."""
    from kimi_megatron_plugin import cpu_parallel

    cpu_parallel.initialize_cpu_parallel(1, 1, 1, rank=0, world_size=1, port=free_port())
    yield
    cpu_parallel.destroy_cpu_parallel()
