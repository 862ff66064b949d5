"""What this plugin provides to ``kimi_rl_glue``, through the ``kimi_rl.plugins`` hooks of
:mod:`kimi_core.plugin_hooks`: the Megatron-Bridge bridges of :data:`kimi_megatron_plugin.registration.MODEL_CLASSES`
for host ``megatron``. Lazy strings only: asking imports neither megatron-core nor megatron-bridge. The trainer
exports adapters in HF / PEFT form already, so this plugin offers no adapter preparation."""

from __future__ import annotations

from kimi_core.plugin_hooks import hookimpl

__all__ = ["HOST", "kimi_rl_models"]

HOST = "megatron"


@hookimpl
def kimi_rl_models(host: str) -> dict[str, str] | None:
    if host != HOST:
        return None
    from kimi_megatron_plugin.registration import MODEL_CLASSES

    return dict(MODEL_CLASSES)
