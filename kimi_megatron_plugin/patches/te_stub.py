"""Patch ``te_stub``: import megatron-bridge without TransformerEngine, through a stand-in scoped to one module.

megatron-bridge's ``megatron/bridge/peft/lora_layers.py`` runs ``import transformer_engine.pytorch as te``
unguarded and evaluates ``te.ops.Sequential`` in a signature at import time. It sits on the import chain
of ``megatron.bridge`` itself (``model_bridge -> peft_bridge -> canonical_lora -> lora_layers``), so without
TE nothing of Bridge imports, not even its registry. TE is GPU-only; the CPU lane has none.

A global fake ``transformer_engine`` would be wrong: megatron-core and Bridge decide ``HAVE_TE`` by whether
``import transformer_engine`` succeeds (megatron-core then reads ``te.__version__`` and picks TE layer
specs). So :func:`install` adds a meta-path finder that intercepts only the import of :data:`UNGUARDED`
modules: while such a module executes, ``transformer_engine`` and ``transformer_engine.pytorch`` are
placeholder modules in ``sys.modules``; afterwards they are removed, so every other ``import
transformer_engine`` still fails and ``HAVE_TE`` stays False. The placeholders' classes are never
instantiated: ``LoRALinear._make_fused_branches`` (the only runtime use) is reached only for TE-wrapped
linears, which a TE-less model has none of.

Does nothing when TransformerEngine is importable. Ledger row: :data:`ENTRY` (collected in
:mod:`kimi_megatron_plugin.patches`), checked by :func:`install` without importing Bridge.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry
from kimi_megatron_plugin.host_support import MEGATRON_BRIDGE

__all__ = ["ENTRY", "UNGUARDED", "install", "installed", "te_available", "uninstall", "unguarded_module_spec"]

#: this patch's ledger row
ENTRY = PatchEntry(
    name="te_stub",
    target="megatron.bridge.peft.lora_layers",
    host=MEGATRON_BRIDGE.distribution,
    versions=MEGATRON_BRIDGE.releases,
    why="lora_layers imports transformer_engine unguarded and sits on megatron.bridge's own import chain",
    how="a meta-path finder puts placeholder transformer_engine modules in sys.modules only while that one "
    "module executes, so HAVE_TE stays False everywhere else",
    upstream="none yet (a guarded TE import in megatron-bridge's peft/lora_layers.py would remove it)",
    remove_when="megatron-bridge imports without TransformerEngine",
    expect="type:ModuleSpec",
)

#: Bridge modules that import TransformerEngine unguarded at import time
UNGUARDED = ("megatron.bridge.peft.lora_layers",)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def unguarded_module_spec(name: str = UNGUARDED[0]) -> importlib.machinery.ModuleSpec | None:
    """Where Bridge's module ``name`` lives, found on disk one package level at a time without executing
    ``megatron.bridge`` (whose import is what fails without TE); None when it is absent."""
    if importlib.util.find_spec("megatron") is None:
        return None
    spec = importlib.util.find_spec("megatron.bridge")
    parts = name.split(".")
    for depth in range(3, len(parts) + 1):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    return spec


def _placeholder_modules() -> dict[str, types.ModuleType]:
    """``transformer_engine`` / ``.pytorch`` with the names ``lora_layers`` touches at import time."""
    te = types.ModuleType("transformer_engine")
    te.__doc__ = "kimi_megatron_plugin.patches.te_stub placeholder (TransformerEngine is not installed)"
    pt = types.ModuleType("transformer_engine.pytorch")

    class _Absent:
        def __init__(self, *a, **k):
            raise RuntimeError(
                "TransformerEngine is not installed; this is kimi_megatron_plugin.patches.te_stub's "
                "import-time placeholder and cannot be used"
            )

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
    """Add the scoped finder (idempotent) when TE is absent; returns True when it is in place.

    :raises kimi_core.errors.PatchTargetError: the installed megatron-bridge is outside the ledger row's
        releases, or no longer has the module the stand-in is scoped to.
    """
    if te_available():
        return False
    if not installed():
        from kimi_megatron_plugin import patches

        if patches.host_release("megatron-bridge") is not None:
            spec = unguarded_module_spec()
            if spec is None:
                raise PatchTargetError(
                    f"patch ledger entry 'te_stub': the installed megatron-bridge has no module {UNGUARDED[0]}; "
                    "re-check which Bridge module imports TransformerEngine unguarded"
                )
            patches.check("te_stub", target_obj=spec)
        sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    """Remove the scoped finder (tests); modules Bridge already imported stay imported."""
    if installed():
        sys.meta_path.remove(_FINDER)
