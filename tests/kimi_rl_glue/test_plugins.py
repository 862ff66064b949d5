"""pluggy hook specs and plugin manager (kimi_rl_glue/hookspecs.py, plugins.py) with fake plugins registered in-test."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest

from kimi_rl_glue import plugins
from kimi_rl_glue.hookspecs import ENTRY_POINT_GROUP, PROJECT, hookimpl


class FakePlugin:
    """Provides one model per host, a loss, a transport and adapter hooks that only claim a 'fake' model."""

    @hookimpl
    def kimi_rl_models(self, host):
        return {"FakeKimiForCausalLM": f"fake_pkg.{host}:FakeKimi"}

    @hookimpl
    def kimi_rl_losses(self, host):
        return {"fake_loss": "fake_pkg.losses:fake"} if host == "miles" else None

    @hookimpl
    def kimi_rl_sync_transports(self, host):
        return {"shm": "fake_pkg.sync:ShmTransport"}

    @hookimpl
    def kimi_rl_export_adapter(self, host, model, lora_spec):
        return [("a.lora_A.weight", 1)] if model == "fake" else None

    @hookimpl
    def kimi_rl_import_adapter(self, host, model, named_tensors):
        return True if model == "fake" else None


def test_fake_plugin_answers_every_hook():
    """A plugin registered by hand answers model, loss, transport and adapter hooks next to the built-in losses."""
    pm = plugins.new_plugin_manager(load_entry_points=False)
    assert pm.project_name == PROJECT
    pm.register(FakePlugin(), name="fake")
    assert plugins.models("vllm", pm) == {"FakeKimiForCausalLM": "fake_pkg.vllm:FakeKimi"}
    miles_losses = plugins.losses("miles", pm)
    assert miles_losses["fake_loss"] == "fake_pkg.losses:fake"
    assert miles_losses["kimi_score_centering"] == "kimi_rl_glue.miles.losses:score_centering_loss"
    assert plugins.sync_transports("sglang", pm) == {"shm": "fake_pkg.sync:ShmTransport"}
    assert pm.hook.kimi_rl_export_adapter(host="megatron", model="fake", lora_spec=None) == [("a.lora_A.weight", 1)]
    assert pm.hook.kimi_rl_export_adapter(host="megatron", model="other", lora_spec=None) is None
    assert pm.hook.kimi_rl_import_adapter(host="sglang", model="fake", named_tensors=[], lora_spec=None) is True


def test_every_builtin_loss_string_resolves():
    """Each loss our built-in plugin advertises for miles, skyrl and demo imports without the host installed."""
    pm = plugins.new_plugin_manager(load_entry_points=False)
    for host in ("miles", "skyrl", "demo"):
        for name, target in plugins.losses(host, pm).items():
            assert callable(plugins.resolve(target)), f"{host}:{name} -> {target}"


def test_conflicting_names_are_an_error_naming_both_plugins():
    """Two plugins that map the same loss name to different functions raise PluginError naming both."""

    class Other:
        @hookimpl
        def kimi_rl_losses(self, host):
            return {"kimi_dapo": "elsewhere:dapo"}

    pm = plugins.new_plugin_manager(load_entry_points=False)
    pm.register(Other(), name="other")
    with pytest.raises(plugins.PluginError, match="'kimi_rl_glue'.*'other'"):
        plugins.losses("miles", pm)


def test_entry_point_group_is_loaded(monkeypatch):
    """A module published under the kimi_rl.plugins entry-point group is imported and registered by name."""
    mod = types.ModuleType("kimi_fake_ep_plugin")

    @hookimpl
    def kimi_rl_models(host):
        return {"EpModel": "ep_pkg:EpModel"}

    mod.kimi_rl_models = kimi_rl_models
    monkeypatch.setitem(sys.modules, "kimi_fake_ep_plugin", mod)
    eps = md.EntryPoints([md.EntryPoint(name="fake_ep", value="kimi_fake_ep_plugin", group=ENTRY_POINT_GROUP)])
    monkeypatch.setattr(plugins.md, "entry_points", lambda: eps)
    pm = plugins.new_plugin_manager()
    assert pm.has_plugin("fake_ep")
    assert plugins.models("sglang", pm) == {"EpModel": "ep_pkg:EpModel"}


def test_broken_entry_point_error_names_it(monkeypatch):
    """An entry point whose module fails to import raises PluginError naming the entry point and group."""
    eps = md.EntryPoints([md.EntryPoint(name="broken", value="kimi_no_such_module_xyz:plugin", group=ENTRY_POINT_GROUP)])
    monkeypatch.setattr(plugins.md, "entry_points", lambda: eps)
    with pytest.raises(plugins.PluginError, match="'broken'.*kimi_rl.plugins"):
        plugins.new_plugin_manager()


def test_bad_host_and_bad_target():
    """An unknown host raises ValueError listing the hosts; an unresolvable target raises ImportError naming it."""
    with pytest.raises(ValueError, match="host="):
        plugins.losses("verl", plugins.new_plugin_manager(load_entry_points=False))
    with pytest.raises(ImportError, match="kimi_rl_glue.losses:nope"):
        plugins.resolve("kimi_rl_glue.losses:nope")


def test_get_plugin_manager_is_cached():
    """get_plugin_manager returns the same manager until refresh=True."""
    a = plugins.get_plugin_manager()
    assert plugins.get_plugin_manager() is a
    assert plugins.get_plugin_manager(refresh=True) is not a
