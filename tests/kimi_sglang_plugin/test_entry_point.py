"""The ``sglang.srt.plugins`` entry point: installed, loadable by SGLang, idempotent, version-checked."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest


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
    from kimi_sglang_plugin.hooks import hooks_for

    specs = hooks_for(plugin.running_sglang())
    before = {s.target: len(HookRegistry._hooks[s.target]) for s in specs}
    register()
    register()
    assert {s.target: len(HookRegistry._hooks[s.target]) for s in specs} == before
    assert all(n == 1 for n in before.values()), before


def test_unsupported_version_is_refused(plugin):
    """Another SGLang release raises one PluginError naming it, the supported releases and what to install."""
    with pytest.raises(plugin.PluginError, match=r"SGLang 0\.5\.22 .*supported: 0\.5\.17, 0\.5\.23.*sglang==0\.5\.23"):
        plugin.check_host(version="0.5.22")
