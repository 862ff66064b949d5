"""SGLang sees K3.1 as K3 + DSA: three hooks (ledger rows ``k31_*`` in :mod:`kimi_sglang_plugin.patches`).

A K3.1 config presents its architectures as ``[K3, K3.1]`` (:mod:`kimi_sglang_plugin.models.kimi_k31_config`),
so every K3 gate of SGLang holds for it. The places that must tell K3.1 apart are hooked here: the DSA gate
``is_deepseek_dsa`` (it selects the indexer, the DSA KV / index pool and the DSA attention backends), the
``index_head_dim`` the DSA index-K pool is sized by, and the model registry's class lookup.

Signatures follow ``HookRegistry``: AROUND hooks get ``(original, *args, **kwargs)``, AFTER hooks
get ``(result, *args, **kwargs)`` and return ``None`` to keep the result.
"""

from __future__ import annotations

from kimi_core.architectures import K31
from kimi_core.errors import PluginError
from kimi_sglang_plugin.models.kimi_k31_config import is_k31_config

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
    if K31 in archs:
        cls = registry.models.get(K31)
        if cls is None:
            raise PluginError(
                f"{K31} is in config.json architectures but not in SGLang's ModelRegistry; "
                "kimi_sglang_plugin.register() did not run in this process (set SGLANG_PLUGINS=kimi "
                "or SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models)"
            )
        return cls, K31
    return original(registry, architectures, *args, **kwargs)
