"""SGLang sees K3.1 as K3 + DSA: three hooks, the rows of :data:`ENTRIES`.

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
from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, HookPatch

__all__ = ["ENTRIES", "is_deepseek_dsa", "derive_index_head_dim", "resolve_model_cls"]

#: this file's ledger rows, in the order they are registered
ENTRIES: tuple[HookPatch, ...] = (
    HookPatch(
        name="k31_dsa_gates.is_deepseek_dsa",
        target="sglang.srt.configs.model_config.is_deepseek_dsa",
        host=HOST,
        hook="around",
        fn=f"{__name__}:is_deepseek_dsa",
        why="is_deepseek_dsa keys DSA on a fixed architecture list without K3/K3.1; it selects the "
        "indexer in DeepseekV2AttentionMLA, the DSA KV/index pool and the DSA attention backends",
        how="AROUND: true when the original is, or when the config is K3.1 (K3.1 in architectures and "
        "index_topk set, kimi_k31_config.is_k31_config); _propagate_patch rebinds the 'from ... import' sites",
        upstream="none (no K3.1 in sglang 0.5.17, 0.5.23 or sglang-miles)",
        remove_when="SGLang lists KimiK31ForConditionalGeneration in is_deepseek_dsa",
        versions=BOTH,
    ),
    HookPatch(
        name="k31_dsa_gates.index_head_dim",
        target="sglang.srt.configs.model_config.ModelConfig._derive_model_shapes",
        host=HOST,
        hook="after",
        fn=f"{__name__}:derive_index_head_dim",
        why="the K3 branch of _derive_model_shapes sets MLA shapes but never index_head_dim, which the "
        "DSA index-K pool (pool_configurator) is sized by",
        how="AFTER: for a K3.1 config set model_config.index_head_dim = text_config.index_head_dim",
        upstream="none",
        remove_when="SGLang derives index_head_dim for K3-family DSA configs",
        versions=BOTH,
    ),
    HookPatch(
        name="k31_dsa_gates.resolve_model_cls",
        target="sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        host=HOST,
        hook="around",
        fn=f"{__name__}:resolve_model_cls",
        why="a K3.1 config reads as K3 to every arch gate (kimi_k31_config.KimiK31Config), so the registry's "
        "first-arch path would build the stock K3 class",
        how="AROUND: when KimiK31ForConditionalGeneration is in the architectures list, return our "
        "class from ModelRegistry.models (resolved arch name K3.1)",
        upstream="none",
        remove_when="K3.1 is in-tree, or SGLang resolves by model_type",
        versions=BOTH,
    ),
)


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
