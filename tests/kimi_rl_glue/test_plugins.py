"""The plugin manager (kimi_rl_glue/plugins.py) over the hook specs of kimi_core/plugin_hooks.py: fake plugins
registered in-test, the members' installed ``kimi_rl.plugins`` entry points, conflicts, and the demo's calls."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # sync_adapters

from kimi_core.plugin_hooks import ENTRY_POINT_GROUP, PROJECT, hookimpl
from kimi_rl_glue import plugins


class FakePlugin:
    """Provides one model per host, a loss, a transport and an adapter preparation for SGLang."""

    @hookimpl
    def kimi_rl_models(self, host):
        return {"FakeKimiForCausalLM": f"fake_pkg.{host}:FakeKimi"}

    @hookimpl
    def kimi_rl_losses(self, host):
        return {"fake_loss": "fake_pkg.losses:fake"} if host == "miles" else None

    @hookimpl
    def kimi_rl_sync_transports(self, host):
        return {"fake_ipc": "fake_pkg.sync:FakeTransport"} if host == "sglang" else None

    @hookimpl
    def kimi_rl_adapter_preparation(self, host):
        return "fake_pkg.adapters:prepare" if host == "sglang" else None


def test_fake_plugin_answers_every_hook():
    """A plugin registered by hand answers model, loss, transport and adapter-preparation hooks next to the glue's
    own losses and transports."""
    pm = plugins.new_plugin_manager(load_entry_points=False)
    assert pm.project_name == PROJECT
    pm.register(FakePlugin(), name="fake")
    assert plugins.models("vllm", pm) == {"FakeKimiForCausalLM": "fake_pkg.vllm:FakeKimi"}
    miles_losses = plugins.losses("miles", pm)
    assert miles_losses["fake_loss"] == "fake_pkg.losses:fake"
    assert miles_losses["kimi_score_centering"] == "kimi_rl_glue.miles.losses:score_centering_loss"
    assert plugins.sync_transports("sglang", pm) == {
        "sglang_tensors": "kimi_rl_glue.demo.sglang_rollout:SglangTensorSync",
        "fake_ipc": "fake_pkg.sync:FakeTransport",
    }
    assert plugins.collect_one("kimi_rl_adapter_preparation", "sglang", pm) == "fake_pkg.adapters:prepare"
    assert plugins.collect_one("kimi_rl_adapter_preparation", "vllm", pm) is None


def test_every_builtin_string_resolves():
    """Each loss and transport the glue advertises imports without the host installed (CUDA IPC only on use)."""
    pm = plugins.new_plugin_manager(load_entry_points=False)
    for host in ("miles", "skyrl", "demo"):
        for name, target in plugins.losses(host, pm).items():
            assert callable(plugins.resolve(target)), f"{host}:{name} -> {target}"
    from kimi_core.sync import AdapterTransport

    for host in ("vllm", "skyrl", "miles"):
        for name, target in plugins.sync_transports(host, pm).items():
            assert issubclass(plugins.resolve(target), AdapterTransport), f"{host}:{name} -> {target}"


def test_conflicting_names_are_an_error_naming_both_plugins():
    """Two plugins that map the same loss name to different functions, or prepare adapters for the same host
    differently, raise PluginError naming both plugins."""

    class Other:
        @hookimpl
        def kimi_rl_losses(self, host):
            return {"kimi_dapo": "elsewhere:dapo"}

        @hookimpl
        def kimi_rl_adapter_preparation(self, host):
            return "elsewhere:prepare" if host == "sglang" else None

    pm = plugins.new_plugin_manager(load_entry_points=False)
    pm.register(Other(), name="other")
    with pytest.raises(plugins.PluginError, match="'kimi_rl_glue'.*'other'"):
        plugins.losses("miles", pm)
    pm.register(FakePlugin(), name="fake")
    with pytest.raises(plugins.PluginError, match=r"both plugin '(other|fake)'.*plugin '(fake|other)'"):
        plugins.adapter_preparation("sglang", pm)


def test_installed_members_are_found_through_their_entry_points():
    """The members installed in this venv publish ``kimi_rl.plugins`` entry points; the manager loads them and
    answers with each plugin's own tables: the models of every engine's and the trainer's ``MODEL_CLASSES`` (the
    same architectures for vLLM, SGLang's K3-family rows, the bridges for Megatron) and each engine plugin's
    ``adapters.prepare_adapter``."""
    from kimi_megatron_plugin.registration import MODEL_CLASSES as MEGATRON
    from kimi_sglang_plugin.registration import MODEL_CLASSES as SGLANG
    from kimi_vllm_plugin.registration import MODEL_CLASSES as VLLM

    names = {ep.name: ep.value for ep in md.entry_points().select(group=ENTRY_POINT_GROUP)}
    for member in ("kimi_vllm_plugin", "kimi_sglang_plugin", "kimi_megatron_plugin"):
        assert names.get(member) == f"{member}.rl_hooks", names
    pm = plugins.new_plugin_manager()
    assert all(pm.has_plugin(m) for m in ("kimi_vllm_plugin", "kimi_sglang_plugin", "kimi_megatron_plugin"))
    assert plugins.models("vllm", pm) == VLLM and plugins.models("sglang", pm) == SGLANG
    assert plugins.models("megatron", pm) == MEGATRON
    assert plugins.models("vllm", pm)["KimiK31ForConditionalGeneration"].startswith("kimi_vllm_plugin.models.")
    import kimi_sglang_plugin.adapters
    import kimi_vllm_plugin.adapters

    assert plugins.adapter_preparation("vllm", pm) is kimi_vllm_plugin.adapters.prepare_adapter
    assert plugins.adapter_preparation("sglang", pm) is kimi_sglang_plugin.adapters.prepare_adapter
    with pytest.raises(plugins.PluginError, match="no installed kimi_rl plugin prepares adapters for host 'megatron'"):
        plugins.adapter_preparation("megatron", pm)


def test_demo_transport_choice_goes_through_the_hooks(tmp_path):
    """The demo's sync transport comes from the plugin manager: for vLLM the disk transport rooted at the folder it
    was given (and a round trip through it), for SGLang the tensor transport with the trainer's config; a plugin
    that offers a second SGLang transport makes the choice need a name, which then picks it."""
    from sync_adapters import make_adapter

    from kimi_rl_glue.demo.sglang_rollout import SglangTensorSync
    from kimi_rl_glue.sync import DiskAdapterSync

    pm = plugins.new_plugin_manager(load_entry_points=False)
    disk = plugins.sync_transport("vllm", pm=pm, root=str(tmp_path / "adapters"), config="cfg")
    assert type(disk) is DiskAdapterSync and disk.root == str(tmp_path / "adapters")
    ad = make_adapter(2)
    disk.publish(ad, 1)
    assert disk.receive(1).tensors.keys() == ad.tensors.keys()
    sglang = plugins.sync_transport("sglang", pm=pm, root="unused", config="cfg")
    assert type(sglang) is SglangTensorSync and sglang.config == "cfg"

    fake = types.ModuleType("kimi_fake_transport")

    class FakeTransport:
        def __init__(self, root):
            self.root = root

    fake.FakeTransport = FakeTransport
    sys.modules["kimi_fake_transport"] = fake
    try:

        class Extra:
            @hookimpl
            def kimi_rl_sync_transports(self, host):
                return {"fake_ipc": "kimi_fake_transport:FakeTransport"} if host == "sglang" else None

        pm.register(Extra(), name="extra")
        with pytest.raises(plugins.PluginError, match=r"transport None for host 'sglang'.*fake_ipc.*sglang_tensors"):
            plugins.sync_transport("sglang", pm=pm, config="cfg")
        assert plugins.sync_transport("sglang", "fake_ipc", pm=pm, root="r", config="cfg").root == "r"
    finally:
        del sys.modules["kimi_fake_transport"]


def test_demo_adapter_preparation_goes_through_the_hooks(monkeypatch):
    """The SGLang transport prepares each version with what the plugin manager answers for host ``sglang``: a
    plugin's preparation that records its call is the one publish runs (then the payload build needs SGLang)."""
    from kimi_core.errors import AdapterRejected
    from kimi_rl_glue.demo.sglang_rollout import SglangTensorSync

    calls = []
    mod = types.ModuleType("kimi_fake_prepare")

    def prepare(adapter, config):
        calls.append((adapter, config))
        raise AdapterRejected("fake preparation refused it")

    mod.prepare = prepare
    monkeypatch.setitem(sys.modules, "kimi_fake_prepare", mod)

    class Prep:
        @hookimpl
        def kimi_rl_adapter_preparation(self, host):
            return "kimi_fake_prepare:prepare" if host == "sglang" else None

    pm = plugins.new_plugin_manager(load_entry_points=False)
    pm.register(Prep(), name="prep")
    monkeypatch.setattr(plugins, "_PM", pm)
    with pytest.raises(AdapterRejected, match="fake preparation refused it"):
        SglangTensorSync("cfg").publish("the adapter", 1)
    assert calls == [("the adapter", "cfg")]


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
    eps = md.EntryPoints(
        [md.EntryPoint(name="broken", value="kimi_no_such_module_xyz:plugin", group=ENTRY_POINT_GROUP)]
    )
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
