"""Kimi K2.x / K3 / K3.1 for vLLM with LoRA (routed experts included), as a ``vllm.general_plugins`` plugin.

Switch it on with the installed entry point ``kimi = "kimi_vllm_plugin:register"`` and
``VLLM_PLUGINS=kimi``. Nothing is imported at the top of this package: vLLM imports it in every
process, and the model classes load lazily in the workers. ``docs/vllm.md`` is the user guide.
"""

__all__ = ["register"]


def register() -> None:
    """``vllm.general_plugins`` entry point; see :func:`kimi_vllm_plugin.registration.register`."""
    from kimi_vllm_plugin.registration import register as _register

    _register()
