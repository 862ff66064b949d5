"""Skip helper of the Python 3.12 lane: the reason names the interpreter or the missing pin."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

LANE = "tests/py312 runs in .venv-py312 (make venv-py312)"


def require(module: str, pin: str):
    """Import ``module`` or skip the calling test module, saying why (Python 3.12 and ``pin`` needed).

    Skips only when the interpreter is not 3.12 or the distribution is absent; a module that is
    installed but fails to import is an error, not a skip.
    """
    if sys.version_info[:2] != (3, 12):
        pytest.skip(f"{LANE}: {pin} needs Python 3.12; this is {sys.version.split()[0]}", allow_module_level=True)
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{LANE}: {pin} is not installed", allow_module_level=True)
        if name == "megatron.bridge":
            # before anything imports Bridge (finding a submodule's spec imports its parents):
            # megatron-bridge 0.6.2 imports TransformerEngine unguarded (te_stub.py says where)
            from kimi_megatron_plugin.patches import te_stub

            te_stub.install()
    return importlib.import_module(module)
