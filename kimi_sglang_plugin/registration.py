"""The ``sglang.srt.plugins`` entry point: check the running SGLang against the releases the plugin
was written for, register the K3.1 config and model class, apply every ledger hook of
:mod:`kimi_sglang_plugin.hooks` that applies to that release.

SGLang calls :func:`register` in every process (``sglang.srt.plugins.load_plugins``), then
``HookRegistry.apply_hooks()``. That call only *logs* a hook it cannot apply, and SGLang only logs a
plugin that raises, after which it silently serves stock code. So :func:`register` never raises:

* supported release (:data:`SUPPORTED_SGLANG`) and every recorded fact holds
  (:mod:`kimi_sglang_plugin.host_facts`): hooks registered, applied and verified, K3.1 registered;
* anything else (another release, a target missing or changed, a hook that did not apply): nothing
  is patched where it can still be avoided, the reason is logged at ERROR, and the K3-family
  architectures are registered as classes whose construction raises that reason
  (:mod:`kimi_sglang_plugin.refusal`), so the engine start fails with it. Other models are unaffected.

Import cost: hooking a symbol imports its module (``pkgutil.resolve_name``), and without
``SGLANG_EXTERNAL_MODEL_PACKAGE`` the model registry imports all ~290 built-in models on first
import; SGLang pays that in its schedulers anyway.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from kimi_core.errors import PluginError as _KimiPluginError
from kimi_sglang_plugin.host_facts import SUPPORTED_SGLANG

__all__ = ["K31_ARCH", "K3_ARCH", "K31_MODEL_TYPE", "SUPPORTED_SGLANG", "PluginError", "check_host",
           "host_problems", "register", "register_hooks", "register_config", "register_models",
           "running_sglang", "sglang_version"]

logger = logging.getLogger(__name__)

K3_ARCH = "KimiK3ForConditionalGeneration"
K31_ARCH = "KimiK31ForConditionalGeneration"
K31_MODEL_TYPE = "kimi_k31"

#: architecture -> ``"module:Class"`` of our model classes
MODELS = {K31_ARCH: "kimi_sglang_plugin.models.kimi_k31:KimiK31ForConditionalGeneration"}

_INSTALL = ("pip install 'kimi-rl-plugins[sglang]' (sglang==0.5.23), or sglang==0.5.17 where torch 2.11 is "
            "pinned (miles' K3 image)")
_STOCK = ("; to serve SGLang's own models without this plugin set SGLANG_PLUGINS to the plugins you want "
          "(SGLANG_PLUGINS=none for none)")

_STATE: dict = {"hooks": False, "config": False, "models": False, "version": None, "refused": None}


class PluginError(_KimiPluginError):
    """SGLang cannot host the Kimi plugin; the message names the release, what differs and what to install."""


def sglang_version() -> str:
    """Installed SGLang version, ``""`` if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


def running_sglang() -> str:
    """The SGLang release :func:`register` checked in this process (else the installed one)."""
    return _STATE["version"] or sglang_version()


def check_host(version: str | None = None) -> str:
    """Raise :class:`PluginError` unless SGLang is installed at a supported release; return it."""
    if importlib.util.find_spec("sglang") is None:
        raise PluginError("kimi_sglang_plugin: SGLang is not installed; " + _INSTALL
                          + ", or 'make venv-sglang' for the lean CPU test venv")
    version = sglang_version() if version is None else version
    if version not in SUPPORTED_SGLANG:
        raise PluginError(f"kimi_sglang_plugin: SGLang {version or '?'} is not a release its hooks were checked "
                          f"against (supported: {', '.join(SUPPORTED_SGLANG)}); {_INSTALL}{_STOCK}")
    return version


def host_problems(version: str) -> list[str]:
    """Everything that differs between the importable SGLang and the recorded facts of ``version``
    (hook targets and the other symbols the plugin uses); empty when the plugin can run."""
    from kimi_sglang_plugin.hooks import check_targets, hooks_for
    from kimi_sglang_plugin.host_facts import check_release, symbols_for

    targets = {s.target for s in hooks_for(version)}
    return check_targets(version) + check_release(version, [s for s in symbols_for(version) if s not in targets])


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


def register_hooks(version: str | None = None) -> None:
    """Check, register, apply and verify every ledger hook that applies to SGLang ``version``.

    Raises :class:`PluginError` naming each problem; nothing is patched when a check fails.
    """
    if _STATE["hooks"]:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_sglang_plugin.hooks import hooks_for, resolve_hook

    version = check_host(version)
    problems = host_problems(version)
    if problems:
        raise PluginError(f"kimi_sglang_plugin: SGLang {version} differs from the release its hooks were checked "
                          f"against: " + "; ".join(problems) + f". Reinstall sglang=={version} from PyPI (a "
                          f"patched or source build differs) or {_INSTALL}{_STOCK}")
    specs = hooks_for(version)
    for spec in specs:
        HookRegistry.register(spec.target, resolve_hook(spec), spec.hook_type())
    HookRegistry.apply_hooks()
    failed = [s.target for s in specs if s.target not in HookRegistry._patched]
    if failed:
        raise PluginError(f"kimi_sglang_plugin: HookRegistry could not apply hooks to {failed} on SGLang {version} "
                          "(the exception is in the SGLang log above)")
    _STATE["version"] = version
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
    """Entry point ``sglang.srt.plugins: kimi``. Re-entrant: a second call does nothing. Never raises.

    Example (what SGLang does in each process, selected by ``SGLANG_PLUGINS=kimi``)::

        from sglang.srt.plugins import load_plugins
        load_plugins()          # calls kimi_sglang_plugin:register, then HookRegistry.apply_hooks()
    """
    if _STATE["refused"] is not None or all(_STATE[k] for k in ("hooks", "config", "models")):
        return
    try:
        version = check_host()
        register_config()
        register_hooks(version)
        register_models()
    except Exception as e:  # noqa: BLE001 - SGLang would swallow it and serve stock code
        message = str(e) if isinstance(e, PluginError) else (
            f"kimi_sglang_plugin: registration failed on SGLang {sglang_version() or '?'} "
            f"({type(e).__name__}: {e}){_STOCK}")
        refuse_kimi(message)
        return
    from kimi_sglang_plugin.hooks import hooks_for

    logger.info("kimi_sglang_plugin: SGLang %s, registered %s, %d hooks applied", version, sorted(MODELS),
                len(hooks_for(version)))


def refuse_kimi(message: str) -> None:
    """Record ``message`` and make every Kimi K3-family architecture fail at construction with it."""
    from kimi_sglang_plugin.refusal import refuse

    _STATE["refused"] = message
    refuse(message)
