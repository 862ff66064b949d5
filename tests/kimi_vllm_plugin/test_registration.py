"""Contract tests of the ``vllm.general_plugins`` entry point (no engine, no device)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from kimi_vllm_plugin import registration  # noqa: E402


def test_entry_point_installed():
    """The installed distribution exposes ``vllm.general_plugins: kimi = kimi_vllm_plugin:register``."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("kimi") == "kimi_vllm_plugin:register"


def test_register_lazy_reentrant_and_loaded_by_vllm():
    """In a fresh process, vLLM's loader with VLLM_PLUGINS=kimi, plus a second register(), leaves one lazy
    ``module:Class`` entry per architecture and imports no model code."""
    code = (
        "import os, sys; os.environ['VLLM_PLUGINS']='kimi'\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from kimi_vllm_plugin import register\n"
        "register()\n"
        "from vllm import ModelRegistry\n"
        "from kimi_vllm_plugin.registration import MODELS\n"
        "for arch, target in MODELS.items():\n"
        "    e = ModelRegistry.models[arch]\n"
        "    assert f'{e.module_name}:{e.class_name}' == target, (arch, e)\n"
        "    assert arch in ModelRegistry.get_supported_archs()\n"
        "bad = [m for m in sys.modules if m.startswith('kimi_vllm_plugin.models') or m == 'vllm.model_executor.models.deepseek_v2']\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_targets_exist_and_are_lora_capable():
    """Every registered string resolves to a class with every SupportsLoRA member and get_expert_mapping."""
    from vllm.model_executor.models.interfaces import supports_lora

    from kimi_vllm_plugin.models.lora_interface import LORA_MEMBERS

    classes = registration.verify_targets()
    assert set(classes) == set(registration.MODELS)
    for arch, cls in classes.items():
        for m in LORA_MEMBERS:
            assert hasattr(cls, m), f"{arch}: {cls.__name__} lacks {m}"
        assert cls.supports_lora is True and cls.is_3d_moe_weight is False
        assert supports_lora(cls), arch
        # the worker checks the built instance (a structural Protocol check for the wrappers)
        assert supports_lora(cls.__new__(cls)), arch


def test_missing_base_class_is_a_clear_error():
    """A missing upstream module or class raises PluginError naming it (vLLM would only log it)."""
    with pytest.raises(registration.PluginError, match=r"vllm\.model_executor\.models\.nope"):
        registration.check_host({"X": ("vllm.model_executor.models.nope", "Foo")})
    with pytest.raises(registration.PluginError, match=r"deepseek_v2\.NoSuchClass"):
        registration.check_host({"X": ("vllm.model_executor.models.deepseek_v2", "NoSuchClass")})


def test_unsupported_version_is_a_clear_error():
    """A vLLM outside 0.32/0.33 is refused with the release to install."""
    with pytest.raises(registration.PluginError, match=r"0\.31\.0 is not supported.*0\.33"):
        registration.check_host(version="0.31.0")


def test_expert_mapping_order_matches_pack_moe():
    """get_expert_mapping rows are w1 (gate), w2 (down), w3 (up) per expert: vLLM's pack_moe triplet order."""
    from kimi_vllm_plugin.mapping import expert_lora_names, expert_mapping

    rows = expert_mapping(2)
    assert [r[3] for r in rows] == ["w1", "w2", "w3"] * 2
    assert expert_lora_names(2)[:3] == ["experts.0.gate_proj", "experts.0.down_proj", "experts.0.up_proj"]
    assert expert_lora_names(1, "w1", "w2", "w3") == ["experts.0.w1", "experts.0.w2", "experts.0.w3"]
