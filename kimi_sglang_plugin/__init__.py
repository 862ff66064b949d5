"""Kimi K2.x / K3 / K3.1 for SGLang 0.5.17 and 0.5.23 with MoE LoRA, as a ``sglang.srt.plugins`` plugin.

Switch it on with the installed entry point ``kimi = "kimi_sglang_plugin:register"`` (select it
with ``SGLANG_PLUGINS=kimi``); SGLang calls it in every process it starts (launcher, engine,
schedulers, detokenizer). ``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models`` is the
fallback path: importing that package applies the same hooks. Nothing is imported at the top of
this package. ``docs/sglang.md`` is the user guide.
"""

__all__ = ["register"]


def register() -> None:
    """``sglang.srt.plugins`` entry point; see :func:`kimi_sglang_plugin.registration.register`."""
    from kimi_sglang_plugin.registration import register as _register

    _register()
