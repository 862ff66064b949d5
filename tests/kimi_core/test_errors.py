"""One error-class family: every exception class the packages define derives from ``kimi_core.errors.KimiError``
and keeps a builtin base its callers catch."""

from __future__ import annotations

import ast
import os

import pytest

from kimi_core.errors import KimiError, PatchTargetError, PluginError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("kimi_core", "kimi_megatron_plugin", "kimi_vllm_plugin", "kimi_sglang_plugin", "kimi_rl_glue")
BUILTIN = {"Exception", "ValueError", "RuntimeError", "KeyError", "ImportError", "TypeError", "OSError"}


def _error_classes():
    """``{name: (file:line, base names)}`` of every class whose bases include an exception class."""
    found = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                p = os.path.join(d, f)
                for node in ast.walk(ast.parse(open(p, encoding="utf-8").read(), p)):
                    if isinstance(node, ast.ClassDef):
                        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                        if any(b in BUILTIN or b.endswith("Error") for b in bases):
                            found.setdefault(node.name, []).append((f"{os.path.relpath(p, ROOT)}:{node.lineno}", bases))
    return found


def test_every_error_class_is_a_kimi_error():
    """Each exception class reaches KimiError through its bases (aliases ``_KimiPluginError`` included)."""
    classes = _error_classes()
    ours = {"KimiError", "_KimiPluginError"}

    def reaches(name, seen=frozenset()):
        if name in ours:
            return True
        return name not in seen and any(reaches(b, seen | {name}) for _, bases in classes.get(name, []) for b in bases)

    assert len(classes) >= 20, sorted(classes)  # the scan sees the classes (ConfigError, PluginError, ...)
    bad = [
        f"{where} class {name}({', '.join(bases)})"
        for name, rows in classes.items()
        if name != "KimiError"
        for where, bases in rows
        if not any(reaches(b, frozenset({name})) for b in bases)
    ]
    assert not bad, "exception classes outside the kimi_core.errors family:\n" + "\n".join(bad)


def test_family_keeps_builtin_bases():
    """``except RuntimeError`` still catches a PluginError; a PatchTargetError is a PluginError."""
    assert issubclass(PluginError, RuntimeError) and issubclass(PatchTargetError, PluginError)
    with pytest.raises(KimiError):
        raise PatchTargetError("x")
