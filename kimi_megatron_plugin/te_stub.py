"""Import megatron-bridge without TransformerEngine: a stand-in ``transformer_engine`` scoped to one module.

Upstream assumption (megatron-bridge 0.6.2): ``megatron/bridge/peft/lora_layers.py`` runs
``import transformer_engine.pytorch as te`` unguarded and evaluates ``te.ops.Sequential`` in a
signature at import time. It sits on the import chain of ``megatron.bridge`` itself
(``model_bridge -> peft_bridge -> canonical_lora -> lora_layers``), so without TE nothing of
Bridge imports, not even its registry. TE is GPU-only; the CPU lane has none.

A global fake ``transformer_engine`` would be wrong: megatron-core and Bridge decide ``HAVE_TE``
by whether ``import transformer_engine`` succeeds (megatron-core then reads ``te.__version__``
and picks TE layer specs). So :func:`install` adds a meta-path finder that intercepts only the
import of :data:`UNGUARDED` modules: while such a module executes, ``transformer_engine`` and
``transformer_engine.pytorch`` are placeholder modules in ``sys.modules``; afterwards they are
removed, so every other ``import transformer_engine`` still fails and ``HAVE_TE`` stays False.
The placeholders' classes are never instantiated: :meth:`LoRALinear._make_fused_branches`
(the only runtime use) is reached only for TE-wrapped linears, which a TE-less model has none of.

Does nothing when TransformerEngine is importable. Remove when Bridge guards that import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["UNGUARDED", "install", "installed", "te_available"]

# Bridge modules that import TransformerEngine unguarded at import time
UNGUARDED = ("megatron.bridge.peft.lora_layers",)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _placeholder_modules() -> dict[str, types.ModuleType]:
    """``transformer_engine`` / ``.pytorch`` with the names ``lora_layers`` touches at import time."""
    te = types.ModuleType("transformer_engine")
    te.__doc__ = "kimi_megatron_plugin.te_stub placeholder (TransformerEngine is not installed)"
    pt = types.ModuleType("transformer_engine.pytorch")

    class _Absent:
        def __init__(self, *a, **k):
            raise RuntimeError("TransformerEngine is not installed; this is kimi_megatron_plugin.te_stub's "
                               "import-time placeholder and cannot be used")

    pt.Linear = type("Linear", (_Absent,), {})
    pt.LayerNormLinear = type("LayerNormLinear", (_Absent,), {})
    pt.ops = types.SimpleNamespace(Sequential=type("Sequential", (_Absent,), {}))
    te.pytorch = pt
    return {"transformer_engine": te, "transformer_engine.pytorch": pt}


class _ScopedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        stubs = _placeholder_modules()
        previous = {k: sys.modules.get(k) for k in stubs}
        sys.modules.update(stubs)
        try:
            self.inner.exec_module(module)
        finally:
            for k, v in previous.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:  # pragma: no cover - only if something else put a module there
                    sys.modules[k] = v


class _ScopedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in UNGUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ScopedLoader(spec.loader)
        return spec


_FINDER = _ScopedFinder()


def installed() -> bool:
    return _FINDER in sys.meta_path


def install() -> bool:
    """Add the scoped finder (idempotent) when TE is absent; returns True when it is in place."""
    if te_available():
        return False
    if not installed():
        sys.meta_path.insert(0, _FINDER)
    return True
