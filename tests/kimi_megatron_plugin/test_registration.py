"""The registration table is data: one row per Kimi architecture Bridge can serve, named from kimi_core."""

from __future__ import annotations

import ast
import inspect

import pytest

from kimi_core import architectures


def test_model_classes_cover_the_bridge_architectures():
    """MODEL_CLASSES maps K2, K2.5, K3 and K3.1 (kimi_core's names) to "module:Class" strings; MODEL_TYPES matches."""
    from kimi_megatron_plugin.registration import MODEL_CLASSES, MODEL_TYPES

    want = {architectures.K2, architectures.K25, architectures.K3, architectures.K31}
    assert set(MODEL_CLASSES) == want == set(MODEL_TYPES)
    assert MODEL_TYPES == {
        architectures.K2: "kimi_k2",
        architectures.K25: "kimi_k25",
        architectures.K3: "kimi_k3",
        architectures.K31: "kimi_k31",
    }
    for target in MODEL_CLASSES.values():
        module, _, cls = target.partition(":")
        assert module == "kimi_megatron_plugin.bridge" and cls.isidentifier()


def test_every_target_class_is_defined_in_model_bridge():
    """Each "module:Class" names one of the bridge package's classes, each defined in model_bridge.py's source
    (checked without importing megatron-bridge)."""
    import importlib.util

    from kimi_megatron_plugin import bridge
    from kimi_megatron_plugin.registration import MODEL_CLASSES

    with open(importlib.util.find_spec("kimi_megatron_plugin.bridge.model_bridge").origin) as f:
        defined = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef)}
    assert set(bridge.BRIDGE_CLASSES) <= defined
    for target in MODEL_CLASSES.values():
        assert target.partition(":")[2] in bridge.BRIDGE_CLASSES, target


def test_every_target_resolves_on_any_node():
    """Resolving a row never fails: without megatron-bridge it is a stand-in whose construction says what to install."""
    import importlib

    from kimi_core.errors import PluginError
    from kimi_megatron_plugin import bridge
    from kimi_megatron_plugin.registration import MODEL_CLASSES

    for arch, target in MODEL_CLASSES.items():
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and cls.__name__ == name
        if not bridge.bridge_available():
            with pytest.raises(PluginError, match=rf"{name}: .*megatron-bridge.*kimi-megatron-plugin\[bridge\]"):
                cls()
            assert getattr(importlib.import_module(module), name) is cls, arch


def test_reading_the_table_imports_no_host():
    """registration.py imports only kimi_core: reading it never needs megatron-core or megatron-bridge."""
    from kimi_megatron_plugin import registration

    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(ast.parse(inspect.getsource(registration)))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert imported <= {"__future__", "kimi_core.architectures"}, imported
