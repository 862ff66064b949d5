"""Where the plugin cannot run, register() still returns and the Kimi K3-family architectures fail at
construction with one message (release found, releases supported, the fix); other models are untouched."""

from __future__ import annotations

import logging

import pytest

from kimi_sglang_plugin.refusal import REFUSED_ARCHS


@pytest.fixture
def fresh(plugin, monkeypatch):
    """A registration state as in a new process, on a copy of the model registry (the session's stays)."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(plugin, "_STATE", {k: False for k in ("hooks", "config", "models")} | {
        "version": None, "refused": None})
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    yield plugin, ModelRegistry
    assert {t: len(h) for t, h in HookRegistry._hooks.items() if h} == {t: n for t, n in before.items() if n}, \
        "a refused registration registered hooks"


def _refusal_of(registry, arch):
    cls, _ = registry.resolve_model_cls([arch])
    assert getattr(cls, "kimi_refusal", None), f"{arch} resolves to {cls}, not a refusal class"
    return cls


def test_unsupported_release_refuses_kimi_only(fresh, monkeypatch, caplog):
    """SGLang 0.5.20 (faked): register() returns, logs the reason at ERROR, K3 / K3-linear / K3.1 raise it
    at construction; DeepSeek-V3 (K2.x) and other models resolve to SGLang's own classes."""
    reg, registry = fresh
    stock = {a: registry.models.get(a) for a in ("DeepseekV3ForCausalLM", "LlamaForCausalLM")}
    monkeypatch.setattr(reg, "sglang_version", lambda: "0.5.20")
    with caplog.at_level(logging.ERROR):
        reg.register()
    assert any("SGLang 0.5.20" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    for arch in REFUSED_ARCHS:
        cls = _refusal_of(registry, arch)
        with pytest.raises(reg.PluginError) as e:
            cls(config=None, quant_config=None, prefix="")
        msg = str(e.value)
        assert "SGLang 0.5.20" in msg and "0.5.17, 0.5.23" in msg and "pip install" in msg, msg
        assert "SGLANG_PLUGINS" in msg, msg
    for arch, cls in stock.items():
        assert registry.models.get(arch) is cls, arch
    reg.register()  # a second call is a no-op, still no exception


def test_changed_target_refuses_with_its_name(fresh, monkeypatch):
    """On a supported release whose hook target differs from the recorded facts nothing is patched, and
    the refusal names the symbol and where the release has it."""
    from kimi_sglang_plugin.host_facts import FACTS, fn

    reg, registry = fresh
    release = reg.sglang_version()
    target = "sglang.srt.lora.utils.get_hidden_dim"
    monkeypatch.setitem(FACTS, target, {**FACTS[target], release: fn("srt/lora/utils.py:146", "module_name")})
    reg.register()
    msg = reg._STATE["refused"]
    assert msg and f"SGLang {release} differs" in msg and target in msg and "utils.py:146" in msg, msg
    with pytest.raises(reg.PluginError, match="get_hidden_dim"):
        _refusal_of(registry, reg.K3_ARCH)(config=None)


def test_unexpected_exception_is_a_refusal_too(fresh, monkeypatch):
    """Any exception inside registration becomes the refusal message instead of escaping into SGLang."""
    reg, registry = fresh

    def boom(version=None):
        raise KeyError("surprise")

    monkeypatch.setattr(reg, "register_hooks", boom)
    reg.register()
    assert "registration failed" in reg._STATE["refused"] and "surprise" in reg._STATE["refused"]
    _refusal_of(registry, reg.K31_ARCH)
