"""Fail where the user looks: the Kimi architectures as classes whose construction raises one error.

SGLang catches an exception raised by a plugin's ``register()`` (``plugins/__init__.py``: "Failed to
execute general plugin") and serves stock code, so a raising plugin only shows a K3.1 user
"architectures ... are not supported" and a K3 user a model without the plugin's fixes. When the
plugin cannot run (SGLang release not checked, a hook target missing or changed), :func:`refuse`
instead logs the reason at ERROR (visible before SGLang configures logging: Python's last-resort
handler prints it) and puts, under each Kimi K3-family architecture name, a class whose
constructor raises :class:`~kimi_sglang_plugin.registration.PluginError` with that reason. The
scheduler builds the model, so the message ends the engine start and is what the user reads.
Every other architecture, DeepSeek-V3 / Kimi K2.x included, is untouched.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["REFUSED_ARCHS", "refusal_class", "refuse"]

logger = logging.getLogger(__name__)

#: the architectures the plugin changes (K2.x runs stock SGLang code and is never refused)
REFUSED_ARCHS = ("KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM", "KimiK31ForConditionalGeneration")


def refusal_class(arch: str, message: str) -> type:
    """An ``nn.Module`` class named ``arch`` whose construction raises ``PluginError(message)``."""
    from kimi_sglang_plugin.registration import PluginError

    def __init__(self, *args, **kwargs):
        raise PluginError(message)

    return type(arch, (torch.nn.Module,), {"__init__": __init__, "__doc__": message, "kimi_refusal": message,
                                            "__module__": __name__})


def _register_k31_config() -> None:
    """K3.1's config must load for its architecture (and so the refusal) to be reached."""
    from kimi_sglang_plugin.registration import register_config

    try:
        register_config()
    except Exception:  # noqa: BLE001 - a release without configs.kimi_k3: K3.1 cannot load at all there
        logger.warning("kimi_sglang_plugin: model_type kimi_k31 not registered", exc_info=True)


def refuse(message: str, archs=REFUSED_ARCHS) -> list[str]:
    """Log ``message`` and register a refusal class under each of ``archs``; returns the archs done.

    Never raises: a failure here is logged and the remaining architectures are still tried.
    """
    logger.error("%s", message)
    _register_k31_config()
    done = []
    try:
        from sglang.srt.models.registry import ModelRegistry
    except Exception:  # noqa: BLE001 - no model registry to put anything in
        logger.exception("kimi_sglang_plugin: SGLang's model registry did not import; Kimi models not refused")
        return done
    for arch in archs:
        try:
            ModelRegistry.models[arch] = refusal_class(arch, message)
            done.append(arch)
        except Exception:  # noqa: BLE001
            logger.exception("kimi_sglang_plugin: could not register the refusal for %s", arch)
    return done
