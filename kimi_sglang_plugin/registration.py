"""The ``sglang.srt.plugins`` entry point: check the running SGLang against the releases the plugin was
written for, register the K3.1 config and model class (:data:`MODEL_CLASSES`), apply every row of the patch
ledger (:mod:`kimi_sglang_plugin.patches`) that applies to that release.

SGLang calls :func:`register` in every process (``sglang.srt.plugins.load_plugins``), then
``HookRegistry.apply_hooks()``. That call only *logs* a hook it cannot apply, and SGLang only logs a
plugin that raises, after which it silently serves stock code. So :func:`register` never raises:

* supported release (:data:`~kimi_sglang_plugin.host_support.SUPPORTED_SGLANG`) and every recorded fact
  holds (:mod:`kimi_sglang_plugin.host_support`): patches checked, applied and verified, K3.1 registered;
* anything else (another release, a target missing or changed, a hook that did not apply): nothing
  is patched where it can still be avoided, the reason is logged at ERROR, and the K3-family
  architectures are registered as classes whose construction raises that reason
  (:func:`kimi_sglang_plugin.host_support.refuse`), so the engine start fails with it. Other models are
  unaffected.

Import cost: hooking a symbol imports its module (``pkgutil.resolve_name``), and without
``SGLANG_EXTERNAL_MODEL_PACKAGE`` the model registry imports all of SGLang's built-in models on first
import; SGLang pays that in its schedulers anyway.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from kimi_core.architectures import K31
from kimi_core.errors import PluginError
from kimi_sglang_plugin.host_support import SUPPORTED_SGLANG, sglang_version

__all__ = [
    "MODEL_CLASSES",
    "check_host",
    "host_problems",
    "register",
    "register_config",
    "register_hooks",
    "register_models",
    "refuse_kimi",
    "running_sglang",
]

logger = logging.getLogger(__name__)

#: HF architecture -> ``"module:Class"`` of our SGLang model class for it
MODEL_CLASSES: dict[str, str] = {K31: "kimi_sglang_plugin.models.kimi_k31:KimiK31ForConditionalGeneration"}

_INSTALL = (
    "pip install 'kimi-rl-plugins[sglang]' (sglang==0.5.23), or sglang==0.5.17 where torch 2.11 is "
    "pinned (miles' K3 image)"
)
_STOCK = (
    "; to serve SGLang's own models without this plugin set SGLANG_PLUGINS to the plugins you want "
    "(SGLANG_PLUGINS=none for none)"
)

_STATE: dict = {"hooks": False, "config": False, "models": False, "version": None, "refused": None}


def running_sglang() -> str:
    """The SGLang release :func:`register` checked in this process (else the installed one)."""
    return _STATE["version"] or sglang_version()


def check_host(version: str | None = None) -> str:
    """Raise :class:`~kimi_core.errors.PluginError` unless SGLang is installed at a supported release; return it."""
    if importlib.util.find_spec("sglang") is None:
        raise PluginError(
            "kimi_sglang_plugin: SGLang is not installed; "
            + _INSTALL
            + ", or 'make venv-sglang' for the lean CPU test venv"
        )
    version = sglang_version() if version is None else version
    if version not in SUPPORTED_SGLANG:
        raise PluginError(
            f"kimi_sglang_plugin: SGLang {version or '?'} is not a release its hooks were checked "
            f"against (supported: {', '.join(SUPPORTED_SGLANG)}); {_INSTALL}{_STOCK}"
        )
    return version


def host_problems(version: str) -> list[str]:
    """Everything that differs between the importable SGLang and the recorded facts of ``version``
    (patch targets and the other symbols the plugin uses); empty when the plugin can run."""
    from kimi_sglang_plugin.host_support import check_release, symbols_for
    from kimi_sglang_plugin.patches import patch_problems, patches_for

    targets = {e.target for e in patches_for(version)}
    return patch_problems(version) + check_release(version, [s for s in symbols_for(version) if s not in targets])


def register_config() -> None:
    """Register ``model_type: kimi_k31`` with SGLang's config registry and ``AutoConfig``."""
    if _STATE["config"]:
        return
    from sglang.srt.utils.hf_transformers import common
    from transformers import AutoConfig

    from kimi_sglang_plugin.models.kimi_k31_config import K31_MODEL_TYPE, KimiK31Config

    common._CONFIG_REGISTRY[K31_MODEL_TYPE] = KimiK31Config
    try:
        AutoConfig.register(K31_MODEL_TYPE, KimiK31Config, exist_ok=True)
    except TypeError:  # older transformers without exist_ok
        AutoConfig.register(K31_MODEL_TYPE, KimiK31Config)
    _STATE["config"] = True


def register_hooks(version: str | None = None) -> None:
    """Check, register, apply and verify every ledger row that applies to SGLang ``version``.

    Raises :class:`~kimi_core.errors.PluginError` naming each problem; nothing is patched when a check fails.
    """
    if _STATE["hooks"]:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_sglang_plugin.patches import patches_for, resolve_hook

    version = check_host(version)
    problems = host_problems(version)
    if problems:
        raise PluginError(
            f"kimi_sglang_plugin: SGLang {version} differs from the release its hooks were checked "
            f"against: " + "; ".join(problems) + f". Reinstall sglang=={version} from PyPI (a "
            f"patched or source build differs) or {_INSTALL}{_STOCK}"
        )
    entries = patches_for(version)
    for entry in entries:
        HookRegistry.register(entry.target, resolve_hook(entry), entry.hook_type())
    HookRegistry.apply_hooks()
    failed = [e.target for e in entries if e.target not in HookRegistry._patched]
    if failed:
        raise PluginError(
            f"kimi_sglang_plugin: HookRegistry could not apply hooks to {failed} on SGLang {version} "
            "(the exception is in the SGLang log above)"
        )
    _STATE["version"] = version
    _STATE["hooks"] = True


def register_models() -> None:
    """Put our classes (:data:`MODEL_CLASSES`) into ``ModelRegistry.models`` under their architecture names."""
    if _STATE["models"]:
        return
    from sglang.srt.models.registry import ModelRegistry

    for arch, target in MODEL_CLASSES.items():
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
    except Exception as e:  # noqa: BLE001 - SGLang's loader must never see a plugin error
        message = (
            str(e)
            if isinstance(e, PluginError)
            else (
                f"kimi_sglang_plugin: registration failed on SGLang {sglang_version() or '?'} "
                f"({type(e).__name__}: {e}){_STOCK}"
            )
        )
        refuse_kimi(message)
        return
    from kimi_sglang_plugin.patches import patches_for

    logger.info(
        "kimi_sglang_plugin: SGLang %s, registered %s, %d hooks applied",
        version,
        sorted(MODEL_CLASSES),
        len(patches_for(version)),
    )


def refuse_kimi(message: str) -> None:
    """Record ``message`` and make every Kimi K3-family architecture fail at construction with it."""
    from kimi_sglang_plugin.host_support import refuse

    _STATE["refused"] = message
    refuse(message)
