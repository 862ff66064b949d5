"""What this plugin provides to ``kimi_rl_glue``, through the ``kimi_rl.plugins`` hooks of
:mod:`kimi_core.plugin_hooks`: the model classes of :data:`kimi_sglang_plugin.registration.MODEL_CLASSES` and
the adapter preparation :func:`kimi_sglang_plugin.adapters.prepare_adapter`, for host ``sglang``. Lazy strings
only: asking imports neither SGLang nor the model classes."""

from __future__ import annotations

from kimi_core.plugin_hooks import hookimpl

__all__ = ["HOST", "kimi_rl_adapter_preparation", "kimi_rl_models"]

HOST = "sglang"


@hookimpl
def kimi_rl_models(host: str) -> dict[str, str] | None:
    if host != HOST:
        return None
    from kimi_sglang_plugin.registration import MODEL_CLASSES

    return dict(MODEL_CLASSES)


@hookimpl
def kimi_rl_adapter_preparation(host: str) -> str | None:
    return "kimi_sglang_plugin.adapters:prepare_adapter" if host == HOST else None
