"""The registration table is data: one row per Kimi architecture Bridge can serve, named from kimi_core."""

from __future__ import annotations

import ast
import inspect

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
        assert module == "kimi_megatron_plugin.bridge.model_bridge" and cls.isidentifier()


def test_every_target_class_is_defined_in_its_module():
    """Each "module:Class" names a class defined in that module's source (checked without importing megatron-bridge)."""
    import importlib.util

    from kimi_megatron_plugin.registration import MODEL_CLASSES

    for target in MODEL_CLASSES.values():
        module, _, cls = target.partition(":")
        with open(importlib.util.find_spec(module).origin) as f:
            tree = ast.parse(f.read())
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        assert cls in classes, f"{target}: no class {cls} in {module}"


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
