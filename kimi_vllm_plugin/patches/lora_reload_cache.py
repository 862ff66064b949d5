"""Patch ``lora_reload_cache``: reloading a LoRA adapter under a name or id the engine has served before resets
the prefix cache, so no request reuses KV computed under the previous adapter (the row is :data:`ENTRY`).

vLLM's prefix cache keys a LoRA request's blocks on the adapter's name (0.26, 0.30) or name and path (0.32 - 0.34),
never on its content, and no release resets it when an adapter is reloaded. A host that reloads a new version in
place under one fixed name and folder (SkyRL's ``/skyrl/v1/load_lora_adapter``: ``"skyrl-lora"``, the same
``lora_int_id``, ``load_inplace=True``, one ``lora_sync_path``; miles alike) therefore gets cache hits on KV the
previous version computed: the next rollout's shared prompt prefix is served by the old policy
(vllm-project/vllm#42125).

The wrapped ``EngineCore.add_lora`` decides before the load whether the adapter's files are (re)read under a
name or id this engine core served before:

* ``load_inplace`` and (the id is loaded, or this core loaded that id or name before);
* not in place, the id not loaded, and this core loaded that id or name before (a host that unloaded the
  adapter and loads a new version under the old name: vLLM's key is the same).

If so, after a load that did not raise it resets the prefix cache (``EngineCore.reset_prefix_cache()``; when
running requests still hold blocks, ``reset_prefix_cache(reset_running_requests=True)``: they are preempted and
recompute their KV under the new adapter, as vLLM's own weight-update flows do) and logs one line. A first load,
another id under another name, or re-adding a loaded id without ``load_inplace`` (vLLM keeps the loaded
tensors) change nothing.

**Scope.** Only engines serving one of our architectures
(:data:`kimi_vllm_plugin.registration.MODEL_CLASSES`, read from ``vllm_config.model_config.architectures``);
other models' engines call the original unchanged, so installing the plugin changes nothing for them.

**Installed** from :func:`kimi_vllm_plugin.registration.register` (the ``vllm.general_plugins`` entry point,
every vLLM process) by :func:`install`: at once if ``vllm.v1.engine.core`` is imported (an engine-core
process: ``EngineCore.__init__`` loads the plugins), else on that module's import through a one-module import
hook (an in-process core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where vLLM may load the plugins before it imports
the core). Idempotent; never raises into vLLM's plugin loader or into an import.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import logging
import sys

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "TARGET_MODULE", "apply", "install", "reload_resets_cache"]

logger = logging.getLogger(__name__)

#: the module holding the target; the import hook waits for this one name only
TARGET_MODULE = "vllm.v1.engine.core"

ENTRY = PatchEntry(
    name="lora_reload_cache",
    target="vllm.v1.engine.core.EngineCore.add_lora",
    host="vllm",
    versions=">=0.26,<0.35",
    why="vLLM keys prefix-cache blocks of a LoRA request on the adapter's name (0.26, 0.30) or name and path "
    "(0.32 - 0.34), not its content, and neither add_lora nor the /v1/load_lora_adapter route resets the cache: "
    "a host that reloads a new adapter version in place under a fixed name and folder (SkyRL's "
    "/skyrl/v1/load_lora_adapter, 'skyrl-lora' with load_inplace; miles) serves cached prefixes computed under "
    "the previous version",
    how="wrap EngineCore.add_lora (EngineCoreProc and the in-process core inherit it): for an engine serving one "
    "of our architectures, when the load (re)reads an adapter under an id or name this core served before "
    "(load_inplace of a loaded or earlier id/name, or an unloaded earlier id/name loaded again), call the "
    "original, then reset_prefix_cache() (with reset_running_requests=True when running requests hold blocks) "
    "and log one line. Target read in vLLM 0.26.0, 0.30.0, 0.32.0, 0.33.0 and 0.34.0: "
    "add_lora(self, lora_request: LoRARequest) -> bool, "
    "reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool, list_loras() -> "
    "set[int], LoRARequest.load_inplace, and WorkerLoRAManager.add_adapter re-reading the files when "
    "load_inplace is set, in all five. Installed by register(): at once in an engine-core process, else by a "
    "one-module import hook on vllm.v1.engine.core; idempotent",
    upstream="vllm-project/vllm#42125 (stale prefix-cache KV after an in-place LoRA reload); "
    "vllm-project/vllm#48352 (open: keys the cache on adapter content, for local paths only)",
    remove_when="content-keyed LoRA prefix caching is in every supported vLLM release",
    expect="signature:(self, lora_request: vllm.lora.request.LoRARequest) -> bool",
)

#: set on our wrapper: the class is patched already
_WRAPPED_FLAG = "_kimi_lora_reload_cache"
#: engine-core instance attribute: ``{lora_int_id: lora_name}`` of every adapter it was asked to load
_SERVED_ATTR = "_kimi_loras_served"
#: engine-core instance attribute: whether it serves one of our architectures (decided once)
_SCOPED_ATTR = "_kimi_lora_reload_scoped"


def install() -> None:
    """Patch ``EngineCore.add_lora`` now if :data:`TARGET_MODULE` is imported, else when it is. Never raises.

    Called from the plugin entry point in every vLLM process; a failure is logged as a warning and vLLM serves
    on without the reset.
    """
    try:
        module = sys.modules.get(TARGET_MODULE)
        if module is not None:
            apply(module)
        elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
    except Exception:  # noqa: BLE001 - runs inside vLLM's plugin loader, which must never see our error
        logger.warning(
            "kimi_vllm_plugin: patch %s not installed; an adapter reloaded under a fixed name may be served "
            "stale prefix-cache KV (reset the prefix cache after each reload)",
            ENTRY.name,
            exc_info=True,
        )


def apply(module) -> None:
    """Wrap ``module.EngineCore.add_lora`` (``module`` is :data:`TARGET_MODULE`) once, after checking the row.

    :raises kimi_core.errors.PatchTargetError: ``add_lora`` or ``reset_prefix_cache`` is not what the row
        recorded.
    """
    from kimi_core.patch_ledger import check_patch

    core_cls = getattr(module, "EngineCore", None)
    if core_cls is None:
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r} (target {ENTRY.target}): {module.__name__} has no EngineCore"
        )
    current = core_cls.add_lora
    if getattr(current, _WRAPPED_FLAG, False):
        return
    check_patch(ENTRY, target_obj=current)
    _check_reset(core_cls)

    @functools.wraps(current)
    def add_lora(self, lora_request):
        if not _serves_kimi(self):
            return current(self, lora_request)
        stale = reload_resets_cache(self, lora_request)
        loaded = current(self, lora_request)
        self.__dict__.setdefault(_SERVED_ATTR, {})[lora_request.lora_int_id] = lora_request.lora_name
        if stale:
            _reset_prefix_cache(self, lora_request)
        return loaded

    setattr(add_lora, _WRAPPED_FLAG, True)
    core_cls.add_lora = add_lora


def reload_resets_cache(core, lora_request) -> bool:
    """Whether loading ``lora_request`` into engine core ``core`` (re)reads an adapter under an id or name the
    core served before, so cached KV under that name may be the previous adapter's (decided before the load).
    """
    served = core.__dict__.get(_SERVED_ATTR, {})
    seen = lora_request.lora_int_id in served or lora_request.lora_name in served.values()
    if lora_request.load_inplace:
        return seen or lora_request.lora_int_id in core.list_loras()
    return seen and lora_request.lora_int_id not in core.list_loras()


def _reset_prefix_cache(core, lora_request) -> None:
    """Reset ``core``'s prefix cache, preempting running requests if they hold blocks; log one line."""
    what = f"kimi_vllm_plugin: LoRA {lora_request.lora_name!r} (id {lora_request.lora_int_id}) reloaded"
    if core.reset_prefix_cache():
        logger.info("%s: prefix cache reset", what)
        return
    try:
        core.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError as e:  # vLLM: requests waiting for a remote KV transfer cannot be preempted
        logger.error("%s: prefix cache NOT reset (%s); cached prefixes may be the previous adapter's", what, e)
        return
    logger.info("%s: prefix cache reset (running requests preempted; they recompute under the new adapter)", what)


def _serves_kimi(core) -> bool:
    """True when ``core``'s model is one of our architectures (decided once per core)."""
    scoped = core.__dict__.get(_SCOPED_ATTR)
    if scoped is None:
        from kimi_vllm_plugin.registration import MODEL_CLASSES

        archs = getattr(getattr(getattr(core, "vllm_config", None), "model_config", None), "architectures", None)
        scoped = core.__dict__[_SCOPED_ATTR] = bool(set(archs or ()) & set(MODEL_CLASSES))
    return scoped


def _check_reset(core_cls) -> None:
    """The reset the wrapper calls: ``reset_prefix_cache(reset_running_requests=...)`` and ``list_loras()``."""
    where = f"patch ledger entry {ENTRY.name!r} (target {ENTRY.target})"
    reset = getattr(core_cls, "reset_prefix_cache", None)
    if reset is None or "reset_running_requests" not in inspect.signature(reset).parameters:
        raise PatchTargetError(f"{where}: EngineCore.reset_prefix_cache(reset_running_requests=...) is missing")
    if not callable(getattr(core_cls, "list_loras", None)):
        raise PatchTargetError(f"{where}: EngineCore.list_loras is missing")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that finds nothing itself: for :data:`TARGET_MODULE` alone it takes the spec
    of the finders after it and wraps the loader so :func:`apply` runs once the module has executed; then it
    removes itself. Every other import costs one string comparison."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        try:
            sys.meta_path.remove(self)
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        except Exception:  # noqa: BLE001 - an import must never fail because of the plugin; vLLM's finders go on
            logger.warning("kimi_vllm_plugin: patch %s not installed", ENTRY.name, exc_info=True)
            return None


class _PatchingLoader(importlib.abc.Loader):
    """The real loader of :data:`TARGET_MODULE`, then :func:`apply` on the executed module (never raising)."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            apply(module)
        except Exception:  # noqa: BLE001 - importing vLLM's engine core must never fail because of the plugin
            logger.warning("kimi_vllm_plugin: patch %s not installed", ENTRY.name, exc_info=True)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the real loader's
        if name == "_inner":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)
