"""Hooks that make SGLang treat K3.1 as K3 + DSA (ledger: :mod:`kimi_sglang_plugin.hooks`).

Signatures follow ``HookRegistry``: AROUND hooks get ``(original, *args, **kwargs)``, AFTER hooks
get ``(result, *args, **kwargs)`` and return ``None`` to keep the result.
"""

from __future__ import annotations

from kimi_sglang_plugin.config import is_k31_config
from kimi_sglang_plugin.registration import K31_ARCH

__all__ = ["is_deepseek_dsa", "derive_index_head_dim", "resolve_model_cls"]


def is_deepseek_dsa(original, config) -> bool:
    """``original(config)`` or K3.1 (``config``: HF dict or ``PretrainedConfig``, top or text)."""
    return bool(original(config)) or is_k31_config(config)


def derive_index_head_dim(result, model_config, *args, **kwargs):
    """After ``ModelConfig._derive_model_shapes``: give a K3.1 model its ``index_head_dim``."""
    text = getattr(model_config, "hf_text_config", None)
    if text is not None and is_k31_config(text):
        model_config.index_head_dim = int(text.index_head_dim)
    return None


def resolve_model_cls(original, registry, architectures, *args, **kwargs):
    """K3.1 architectures list -> ``(our class, "KimiK31ForConditionalGeneration")``."""
    archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
    if K31_ARCH in archs:
        cls = registry.models.get(K31_ARCH)
        if cls is None:
            from kimi_sglang_plugin.registration import PluginError

            raise PluginError(f"{K31_ARCH} is in config.json architectures but not in SGLang's ModelRegistry; "
                              "kimi_sglang_plugin.register() did not run in this process (set SGLANG_PLUGINS=kimi "
                              "or SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models)")
        return cls, K31_ARCH
    return original(registry, architectures, *args, **kwargs)
