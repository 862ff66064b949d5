"""The plugin manager: the one place the glue loads the ``kimi_rl.plugins`` entry points and asks them what they
provide, as data (hook specs: :mod:`kimi_core.plugin_hooks`).

``get_plugin_manager()`` is cached per process (entry points are read once); ``new_plugin_manager()`` builds a
fresh one (tests, or after installing a plugin). Our own hooks (:class:`BuiltinPlugin`: the glue's losses and
sync transports) are always registered first. Callers ask through :func:`models`, :func:`adapter_preparation`,
:func:`sync_transports` / :func:`sync_transport` and :func:`losses` instead of importing a plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pluggy

from kimi_core.errors import PluginError
from kimi_core.plugin_hooks import ENTRY_POINT_GROUP, HOSTS, PROJECT, KimiRLSpec, hookimpl

__all__ = [
    "BuiltinPlugin",
    "PluginError",
    "adapter_preparation",
    "collect",
    "collect_one",
    "get_plugin_manager",
    "losses",
    "models",
    "new_plugin_manager",
    "resolve",
    "sync_transport",
    "sync_transports",
]

log = logging.getLogger(__name__)
_PM: pluggy.PluginManager | None = None


class BuiltinPlugin:
    """Our own hook implementations: this package's losses and adapter-sync transports, as lazy strings per
    host. Model classes and adapter preparation come from the plugins that own them (their ``rl_hooks``)."""

    name = "kimi_rl_glue"
    LOSSES = {
        "miles": {
            "kimi_score_centering": "kimi_rl_glue.miles.losses:score_centering_loss",
            "kimi_dapo": "kimi_rl_glue.miles.losses:dapo_loss",
        },
        "skyrl": {
            "kimi_dapo": "kimi_rl_glue.skyrl.losses:kimi_dapo_policy_loss",
            "kimi_grpo": "kimi_rl_glue.skyrl.losses:kimi_grpo_policy_loss",
        },
        "demo": {
            "score_centering": "kimi_rl_glue.losses.score_centering:score_centering_from_logits",
            "grpo": "kimi_rl_glue.losses.policy:policy_loss",
        },
    }

    _DISK = "kimi_rl_glue.sync.disk:DiskAdapterSync"
    _CUDA_IPC = "kimi_rl_glue.sync.cuda_ipc:CudaIpcAdapterSync"
    SYNC_TRANSPORTS = {
        "vllm": {"disk": _DISK},
        "skyrl": {"disk": _DISK},
        "sglang": {"sglang_tensors": "kimi_rl_glue.demo.sglang_rollout:SglangTensorSync"},
        "miles": {"cuda_ipc": _CUDA_IPC},
    }

    @hookimpl
    def kimi_rl_losses(self, host: str):
        return self.LOSSES.get(host)

    @hookimpl
    def kimi_rl_sync_transports(self, host: str):
        return self.SYNC_TRANSPORTS.get(host)


def _load_entry_points(pm: pluggy.PluginManager, group: str) -> list[str]:
    loaded = []
    for ep in md.entry_points().select(group=group):
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            obj = ep.load()
        except Exception as e:
            dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
            raise PluginError(
                f"plugin entry point {ep.name!r} = {ep.value!r} (group {group!r}, distribution "
                f"{dist}) failed to import: {type(e).__name__}: {e}. Fix or uninstall that "
                f"package, or block it with get_plugin_manager().set_blocked({ep.name!r})"
            ) from e
        pm.register(obj, name=ep.name)
        loaded.append(ep.name)
    return loaded


def new_plugin_manager(load_entry_points: bool = True, builtin: bool = True) -> pluggy.PluginManager:
    """A fresh manager with our hook specs, our built-in plugin and (optionally) the installed entry points."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(KimiRLSpec)
    if builtin:
        pm.register(BuiltinPlugin(), name=BuiltinPlugin.name)
    if load_entry_points:
        names = _load_entry_points(pm, ENTRY_POINT_GROUP)
        if names:
            log.debug("loaded kimi_rl plugins: %s", ", ".join(names))
    return pm


def get_plugin_manager(refresh: bool = False) -> pluggy.PluginManager:
    """The process-wide manager (built on first use; ``refresh=True`` rebuilds it)."""
    global _PM
    if _PM is None or refresh:
        _PM = new_plugin_manager()
    return _PM


def _plugin_name(pm: pluggy.PluginManager, impl) -> str:
    return pm.get_name(impl.plugin) or repr(impl.plugin)


def collect(hook_name: str, host: str, pm: pluggy.PluginManager | None = None) -> dict[str, str]:
    """Merge the dicts that every plugin returns from a dict hook for ``host``.

    :raises PluginError: two plugins return the same key (the message names both plugins and the key).
    :raises ValueError: ``host`` is not one of ``HOSTS``.
    """
    if host not in HOSTS:
        raise ValueError(f"host={host!r}; expected one of {HOSTS}")
    pm = pm or get_plugin_manager()
    caller = getattr(pm.hook, hook_name)
    merged: dict[str, str] = {}
    owner: dict[str, str] = {}
    # Call implementations one by one so a conflict can name the plugin that produced each entry.
    for impl in caller.get_hookimpls():  # registration order (pluggy calls them in reverse)
        res = impl.function(**{a: {"host": host}[a] for a in impl.argnames})
        if res is None:
            continue
        if not isinstance(res, dict):
            raise PluginError(
                f"plugin {_plugin_name(pm, impl)!r}: {hook_name} must return a dict or None, got {type(res).__name__}"
            )
        for k, v in res.items():
            if k in merged and merged[k] != v:
                raise PluginError(
                    f"{hook_name}(host={host!r}): name {k!r} is provided by both plugin "
                    f"{owner[k]!r} ({merged[k]}) and plugin {_plugin_name(pm, impl)!r} ({v}); "
                    "uninstall or block one of them"
                )
            merged[k] = v
            owner[k] = _plugin_name(pm, impl)
    return merged


def collect_one(hook_name: str, host: str, pm: pluggy.PluginManager | None = None) -> str | None:
    """The one answer every plugin gives to a single-valued hook for ``host`` (``None`` when none answers).

    :raises PluginError: two plugins answer differently (the message names both plugins and their answers).
    """
    if host not in HOSTS:
        raise ValueError(f"host={host!r}; expected one of {HOSTS}")
    pm = pm or get_plugin_manager()
    found: tuple[str, str] | None = None
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        res = impl.function(**{a: {"host": host}[a] for a in impl.argnames})
        if res is None:
            continue
        if not isinstance(res, str):
            raise PluginError(
                f"plugin {_plugin_name(pm, impl)!r}: {hook_name} must return a 'module:attr' string or "
                f"None, got {type(res).__name__}"
            )
        if found is not None and found[1] != res:
            raise PluginError(
                f"{hook_name}(host={host!r}) is answered by both plugin {found[0]!r} ({found[1]}) and "
                f"plugin {_plugin_name(pm, impl)!r} ({res}); uninstall or block one of them"
            )
        found = (_plugin_name(pm, impl), res)
    return None if found is None else found[1]


def models(host: str, pm=None) -> dict[str, str]:
    """``{architecture: "module:Class"}`` from every plugin for ``host``."""
    return collect("kimi_rl_models", host, pm)


def losses(host: str, pm=None) -> dict[str, str]:
    """``{loss name: "module:function"}`` from every plugin for ``host``."""
    return collect("kimi_rl_losses", host, pm)


def sync_transports(host: str, pm=None) -> dict[str, str]:
    """``{transport: "module:Class"}`` from every plugin for ``host``."""
    return collect("kimi_rl_sync_transports", host, pm)


def adapter_preparation(host: str, pm=None) -> Callable:
    """``prepare_adapter(adapter, config) -> Adapter`` of the plugin that serves ``host``, imported.

    :raises PluginError: no installed plugin prepares adapters for ``host`` (names what to install), or two do.
    """
    target = collect_one("kimi_rl_adapter_preparation", host, pm)
    if target is None:
        raise PluginError(
            f"no installed kimi_rl plugin prepares adapters for host {host!r} (hook "
            f"kimi_rl_adapter_preparation); install the engine plugin, e.g. kimi-{host}-plugin"
        )
    return resolve(target)


def sync_transport(host: str, name: str | None = None, pm=None, **options) -> Any:
    """A new adapter-sync transport for ``host``: the one the plugins offer (``name`` picks one of several), built
    with those of ``options`` its constructor takes (e.g. ``root=`` for the disk transport, ``config=`` for the
    SGLang one), so a caller passes what it has and the transport takes what it needs.

    :raises PluginError: ``host`` has no transport, ``name`` is not one of them, or several and no ``name``.
    """
    offered = sync_transports(host, pm)
    if name is None and len(offered) == 1:
        name = next(iter(offered))
    if name not in offered:
        raise PluginError(
            f"adapter-sync transport {name!r} for host {host!r}: the installed plugins offer "
            f"{sorted(offered) or 'none'}"
        )
    cls = resolve(offered[name])
    params = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in options.items() if k in params})


def resolve(target: str) -> Any:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``) and return the attribute.

    :raises ImportError: with the target named when the module or attribute is missing.
    """
    mod_name, sep, attr = target.partition(":")
    if not sep:
        mod_name, _, attr = target.rpartition(".")
    if not mod_name or not attr:
        raise ImportError(f"cannot resolve {target!r}: expected 'package.module:attr'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"cannot resolve {target!r}: importing {mod_name!r} failed: {e}") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"cannot resolve {target!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
