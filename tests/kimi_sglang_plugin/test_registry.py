"""Model and config registration: the registry resolves our K3.1 class, K3.1 configs pass the DSA gate."""

from __future__ import annotations

import importlib


def test_registry_resolves_k31(plugin):
    """``ModelRegistry`` maps the K3.1 arch (alone or behind the K3 alias) to our class; K3 stays stock."""
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration
    from sglang.srt.models.registry import ModelRegistry

    from kimi_sglang_plugin.models.kimi_k31 import KimiK31ForConditionalGeneration

    assert ModelRegistry.resolve_model_cls([plugin.K31_ARCH]) == (KimiK31ForConditionalGeneration, plugin.K31_ARCH)
    assert ModelRegistry.resolve_model_cls([plugin.K3_ARCH, plugin.K31_ARCH])[0] is KimiK31ForConditionalGeneration
    assert ModelRegistry.resolve_model_cls([plugin.K3_ARCH])[0] is KimiK3ForConditionalGeneration
    assert issubclass(KimiK31ForConditionalGeneration, KimiK3ForConditionalGeneration)


def test_external_model_package_fallback(plugin):
    """``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models`` yields exactly our class by arch name."""
    from sglang.srt.models.registry import import_model_classes

    found = import_model_classes("kimi_sglang_plugin.models", strict=True)
    mod = importlib.import_module("kimi_sglang_plugin.models.kimi_k31")
    assert found == {plugin.K31_ARCH: mod.KimiK31ForConditionalGeneration}


def test_k31_config_loads_and_opens_dsa_gates(plugin, tiny_ckpt):
    """SGLang's config loader builds KimiK31Config; DSA and K3 gates hold for it (top and text config)."""
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_kimi_k3
    from sglang.srt.utils.hf_transformers.config import get_config

    from kimi_sglang_plugin.config import KimiK31Config

    cfg = get_config(tiny_ckpt("k31"), trust_remote_code=False)
    assert isinstance(cfg, KimiK31Config)
    assert cfg.architectures[:2] == [plugin.K3_ARCH, plugin.K31_ARCH]
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (8, 4, 32)
    for c in (cfg, cfg.text_config):
        assert is_deepseek_dsa(c) and is_kimi_k3(c)
    k3 = get_config(tiny_ckpt("k3"), trust_remote_code=False)
    assert not is_deepseek_dsa(k3) and not is_deepseek_dsa(k3.text_config) and is_kimi_k3(k3)
