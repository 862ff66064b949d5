"""Registration: the ``sglang.srt.plugins`` entry point is installed, loadable by SGLang, idempotent and
version-checked; the registry resolves our K3.1 class and K3.1 configs pass the DSA gate; where the plugin
cannot run, register() still returns and the Kimi K3-family architectures fail at construction with one
message (release found, releases supported, the fix) while other models are untouched."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import pytest

from kimi_core.architectures import K3, K31
from kimi_core.errors import PluginError
from kimi_sglang_plugin.host_support import REFUSED_ARCHS


def test_entry_point_is_installed():
    """The installed distribution declares ``sglang.srt.plugins: kimi = kimi_sglang_plugin:register``."""
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "kimi" in eps, f"entry point missing; found {sorted(eps)} (pip install -e . into this venv)"
    assert eps["kimi"].value == "kimi_sglang_plugin:register"
    from kimi_sglang_plugin import register

    assert eps["kimi"].load() is register


def test_sglang_load_plugins_runs_register(monkeypatch, plugin):
    """SGLang's own loader, restricted by SGLANG_PLUGINS=kimi, finds and runs our plugin."""
    import sglang.srt.plugins as plugins

    monkeypatch.setenv("SGLANG_PLUGINS", "kimi")
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert "kimi" in found
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    assert all(plugin._STATE[k] for k in ("hooks", "config", "models")), plugin._STATE
    assert plugin._STATE["refused"] is None and plugin._STATE["version"] == plugin.sglang_version()


def test_register_is_idempotent(plugin):
    """A second register() adds no second hook to any target of the running release."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_sglang_plugin import register
    from kimi_sglang_plugin.patches import patches_for

    entries = patches_for(plugin.running_sglang())
    before = {e.target: len(HookRegistry._hooks[e.target]) for e in entries}
    register()
    register()
    assert {e.target: len(HookRegistry._hooks[e.target]) for e in entries} == before
    assert all(n == 1 for n in before.values()), before


def test_unsupported_version_is_refused(plugin):
    """Another SGLang release raises one PluginError naming it, the supported releases and what to install."""
    with pytest.raises(PluginError, match=r"SGLang 0\.5\.22 .*supported: 0\.5\.17, 0\.5\.23.*sglang==0\.5\.23"):
        plugin.check_host(version="0.5.22")


def test_registry_resolves_k31(plugin):
    """``ModelRegistry`` maps the K3.1 arch (alone or behind the K3 alias) to our class; K3 stays stock."""
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration
    from sglang.srt.models.registry import ModelRegistry

    from kimi_sglang_plugin.models.kimi_k31 import KimiK31ForConditionalGeneration

    assert ModelRegistry.resolve_model_cls([K31]) == (KimiK31ForConditionalGeneration, K31)
    assert ModelRegistry.resolve_model_cls([K3, K31])[0] is KimiK31ForConditionalGeneration
    assert ModelRegistry.resolve_model_cls([K3])[0] is KimiK3ForConditionalGeneration
    assert issubclass(KimiK31ForConditionalGeneration, KimiK3ForConditionalGeneration)


def test_external_model_package_fallback(plugin):
    """``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models`` yields exactly our class by arch name."""
    from sglang.srt.models.registry import import_model_classes

    found = import_model_classes("kimi_sglang_plugin.models", strict=True)
    mod = importlib.import_module("kimi_sglang_plugin.models.kimi_k31")
    assert found == {K31: mod.KimiK31ForConditionalGeneration}


def test_k31_config_loads_and_opens_dsa_gates(plugin, tiny_ckpt):
    """SGLang's config loader builds KimiK31Config; DSA and K3 gates hold for it (top and text config)."""
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_kimi_k3
    from sglang.srt.utils.hf_transformers.config import get_config

    from kimi_sglang_plugin.models.kimi_k31_config import KimiK31Config

    cfg = get_config(tiny_ckpt("k31"), trust_remote_code=False)
    assert isinstance(cfg, KimiK31Config)
    assert cfg.architectures[:2] == [K3, K31]
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (8, 4, 32)
    for c in (cfg, cfg.text_config):
        assert is_deepseek_dsa(c) and is_kimi_k3(c)
    k3 = get_config(tiny_ckpt("k3"), trust_remote_code=False)
    assert not is_deepseek_dsa(k3) and not is_deepseek_dsa(k3.text_config) and is_kimi_k3(k3)


@pytest.fixture
def fresh(plugin, monkeypatch):
    """A registration state as in a new process, on a copy of the model registry (the session's stays)."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(
        plugin, "_STATE", {k: False for k in ("hooks", "config", "models")} | {"version": None, "refused": None}
    )
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    yield plugin, ModelRegistry
    assert {t: len(h) for t, h in HookRegistry._hooks.items() if h} == {t: n for t, n in before.items() if n}, (
        "a refused registration registered hooks"
    )


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
        with pytest.raises(PluginError) as e:
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
    from kimi_sglang_plugin.host_support import FACTS, fn

    reg, registry = fresh
    release = reg.running_sglang()
    target = "sglang.srt.lora.utils.get_hidden_dim"
    monkeypatch.setitem(FACTS, target, {**FACTS[target], release: fn("srt/lora/utils.py:146", "module_name")})
    reg.register()
    msg = reg._STATE["refused"]
    assert msg and f"SGLang {release} differs" in msg and target in msg and "utils.py:146" in msg, msg
    with pytest.raises(PluginError, match="get_hidden_dim"):
        _refusal_of(registry, K3)(config=None)


def test_unexpected_exception_is_a_refusal_too(fresh, monkeypatch):
    """Any exception inside registration becomes the refusal message instead of escaping into SGLang."""
    reg, registry = fresh

    def boom(version=None):
        raise KeyError("surprise")

    monkeypatch.setattr(reg, "register_hooks", boom)
    reg.register()
    assert "registration failed" in reg._STATE["refused"] and "surprise" in reg._STATE["refused"]
    _refusal_of(registry, K31)
