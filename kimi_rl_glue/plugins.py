"""The plugin manager: loads the ``kimi_rl.plugins`` entry points and answers the hooks as data.

``get_plugin_manager()`` is cached per process (entry points are read once);
``new_plugin_manager()`` builds a fresh one (tests, or after installing a plugin). Our own hooks
(:class:`BuiltinPlugin`) are always registered first, so an installed plugin can override a
``firstresult`` answer but never silently shadow one of our names in a dict hook.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
from typing import Any

import pluggy

from kimi_core.errors import PluginError as _KimiPluginError
from kimi_rl_glue.hookspecs import ENTRY_POINT_GROUP, HOSTS, PROJECT, KimiRLSpec, hookimpl

__all__ = ["PluginError", "BuiltinPlugin", "get_plugin_manager", "new_plugin_manager", "collect", "resolve", "models", "losses",
           "sync_transports"]

log = logging.getLogger(__name__)
_PM: pluggy.PluginManager | None = None


class PluginError(_KimiPluginError):
    """A ``kimi_rl.plugins`` entry point failed to load, or two plugins claim the same name."""


class BuiltinPlugin:
    """Our own hook implementations: this package's losses, as lazy strings per host.

    Model classes, adapter hooks and sync transports come from the packages that own them.
    """

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

    @hookimpl
    def kimi_rl_losses(self, host: str):
        return self.LOSSES.get(host)


def _load_entry_points(pm: pluggy.PluginManager, group: str) -> list[str]:
    loaded = []
    for ep in md.entry_points().select(group=group):
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - re-raised with the entry point named
            dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
            raise PluginError(f"plugin entry point {ep.name!r} = {ep.value!r} (group {group!r}, distribution "
                              f"{dist}) failed to import: {type(e).__name__}: {e}. Fix or uninstall that "
                              f"package, or block it with get_plugin_manager().set_blocked({ep.name!r})") from e
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
            raise PluginError(f"plugin {_plugin_name(pm, impl)!r}: {hook_name} must return a dict or None, "
                              f"got {type(res).__name__}")
        for k, v in res.items():
            if k in merged and merged[k] != v:
                raise PluginError(f"{hook_name}(host={host!r}): name {k!r} is provided by both plugin "
                                  f"{owner[k]!r} ({merged[k]}) and plugin {_plugin_name(pm, impl)!r} ({v}); "
                                  "uninstall or block one of them")
            merged[k] = v
            owner[k] = _plugin_name(pm, impl)
    return merged


def models(host: str, pm=None) -> dict[str, str]:
    """``{architecture: "module:Class"}`` from every plugin for ``host``."""
    return collect("kimi_rl_models", host, pm)


def losses(host: str, pm=None) -> dict[str, str]:
    """``{loss name: "module:function"}`` from every plugin for ``host``."""
    return collect("kimi_rl_losses", host, pm)


def sync_transports(host: str, pm=None) -> dict[str, str]:
    """``{transport: "module:Class"}`` from every plugin for ``host``."""
    return collect("kimi_rl_sync_transports", host, pm)


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
