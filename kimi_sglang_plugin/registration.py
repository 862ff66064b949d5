"""The ``sglang.srt.plugins`` entry point: check the host, register the K3.1 config and model
class, register and apply every hook of :mod:`kimi_sglang_plugin.hooks`, and the MoE LoRA core.

SGLang calls :func:`register` in every process (``sglang.srt.plugins.load_plugins``), then
``HookRegistry.apply_hooks()``. That call only *logs* a hook it cannot apply and SGLang only
logs a plugin that raises, after which it silently serves stock code. So :func:`register` applies
the hooks itself and raises one :class:`PluginError` naming every target it could not patch.

Import cost: hooking a symbol imports its module (``pkgutil.resolve_name``), and without
``SGLANG_EXTERNAL_MODEL_PACKAGE`` the model registry imports all ~290 built-in models on first
import; SGLang pays that in its schedulers anyway. The registry is only touched when the plugin
runs inside SGLang or a test asks for it.
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["K31_ARCH", "K3_ARCH", "K31_MODEL_TYPE", "SUPPORTED_SGLANG", "PluginError", "check_host",
           "register", "register_hooks", "register_config", "register_models", "sglang_version"]

logger = logging.getLogger(__name__)

K3_ARCH = "KimiK3ForConditionalGeneration"
K31_ARCH = "KimiK31ForConditionalGeneration"
K31_MODEL_TYPE = "kimi_k31"

#: SGLang releases whose internals the hooks were written against (targets checked per release)
SUPPORTED_SGLANG = ("0.5.23",)

#: architecture -> ``"module:Class"`` of our model classes
MODELS = {K31_ARCH: "kimi_sglang_plugin.models.kimi_k31:KimiK31ForConditionalGeneration"}

_STATE = {"hooks": False, "config": False, "models": False}


class PluginError(RuntimeError):
    """SGLang cannot host the Kimi plugin; the message names what is missing and what to install."""


def sglang_version() -> str:
    """Installed SGLang version, ``""`` if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


def check_host(version: str | None = None) -> str:
    """Raise :class:`PluginError` unless SGLang is installed at a supported release; return it."""
    if importlib.util.find_spec("sglang") is None:
        raise PluginError("kimi_sglang_plugin: SGLang is not installed; install 'kimi-rl-plugins[sglang]' "
                          "(sglang==0.5.23) on a GPU node, or 'make venv-sglang' for the lean CPU test venv")
    version = sglang_version() if version is None else version
    if version not in SUPPORTED_SGLANG:
        raise PluginError(f"kimi_sglang_plugin: SGLang {version or '?'} is not supported; its hooks target "
                          f"{', '.join(SUPPORTED_SGLANG)} (pip install 'sglang==0.5.23')")
    return version


def register_config() -> None:
    """Register ``model_type: kimi_k31`` with SGLang's config registry and ``AutoConfig``."""
    if _STATE["config"]:
        return
    from transformers import AutoConfig

    from sglang.srt.utils.hf_transformers import common
    from kimi_sglang_plugin.config import KimiK31Config

    common._CONFIG_REGISTRY[K31_MODEL_TYPE] = KimiK31Config
    try:
        AutoConfig.register(K31_MODEL_TYPE, KimiK31Config, exist_ok=True)
    except TypeError:  # older transformers without exist_ok
        AutoConfig.register(K31_MODEL_TYPE, KimiK31Config)
    _STATE["config"] = True


def register_hooks() -> None:
    """Register every ledger hook with ``HookRegistry``, apply them, add the MoE LoRA runner core.

    Raises :class:`PluginError` naming each hook whose target is missing or did not get patched.
    """
    if _STATE["hooks"]:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_sglang_plugin.hooks import HOOKS, check_targets, resolve_hook
    from kimi_sglang_plugin.moe_lora import register_runner_core

    version = check_host()
    missing = check_targets(version)
    if missing:
        raise PluginError("kimi_sglang_plugin: hook targets missing in SGLang " + version + ": " + "; ".join(missing))
    for spec in HOOKS:
        HookRegistry.register(spec.target, resolve_hook(spec), spec.hook_type())
    HookRegistry.apply_hooks()
    failed = [s.target for s in HOOKS if s.target not in HookRegistry._patched]
    if failed:
        raise PluginError(f"kimi_sglang_plugin: HookRegistry could not apply hooks to {failed} "
                          "(see the SGLang log for the exception)")
    register_runner_core()
    _STATE["hooks"] = True


def register_models() -> None:
    """Put our classes into ``ModelRegistry.models`` under their architecture names."""
    if _STATE["models"]:
        return
    from sglang.srt.models.registry import ModelRegistry

    for arch, target in MODELS.items():
        mod, cls = target.split(":")
        ModelRegistry.models[arch] = getattr(importlib.import_module(mod), cls)
    _STATE["models"] = True


def register() -> None:
    """Entry point ``sglang.srt.plugins: kimi``. Re-entrant: a second call does nothing.

    Example (what SGLang does in each process, selected by ``SGLANG_PLUGINS=kimi``)::

        from sglang.srt.plugins import load_plugins
        load_plugins()          # calls kimi_sglang_plugin:register, then HookRegistry.apply_hooks()
    """
    check_host()
    register_config()
    register_hooks()
    register_models()
    logger.info("kimi_sglang_plugin: registered %s, %d hooks", sorted(MODELS), _n_hooks())


def _n_hooks() -> int:
    from kimi_sglang_plugin.hooks import HOOKS

    return len(HOOKS)
