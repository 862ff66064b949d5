"""Kimi K2.x / K3 / K3.1 for vLLM with LoRA (routed experts included), as a ``vllm.general_plugins`` plugin.

Switch it on with the installed entry point ``kimi = "kimi_vllm_plugin:register"`` and
``VLLM_PLUGINS=kimi``. Nothing is imported at the top of this package: vLLM imports it in every
process, and the model classes load lazily in the workers. ``docs/vllm.md`` is the user guide.
"""

__all__ = ["register"]


def register() -> None:
    """``vllm.general_plugins`` entry point; see :func:`kimi_vllm_plugin.registration.register`.

    vLLM calls this unguarded in every process, so even a broken install (the registration module not
    importing) is logged here and never raised into vLLM's plugin loader.
    """
    try:
        from kimi_vllm_plugin.registration import register as _register
    except Exception:
        import logging

        logging.getLogger(__name__).exception(
            "kimi_vllm_plugin: could not import the registration module; Kimi architectures are not registered"
        )
        return
    _register()
