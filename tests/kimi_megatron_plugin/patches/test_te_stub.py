"""The TE stand-in is scoped: it never makes transformer_engine importable, and it refuses a Bridge it was not
checked on."""

from __future__ import annotations

import importlib.util

import pytest

from kimi_core.errors import PatchTargetError


@pytest.fixture
def no_finder():
    """Run with the stand-in's finder out of sys.meta_path, restoring it afterwards."""
    from kimi_megatron_plugin.patches import te_stub

    was = te_stub.installed()
    te_stub.uninstall()
    yield te_stub
    te_stub.uninstall()
    if was:
        te_stub.install()


def test_install_does_not_fake_transformer_engine(no_finder):
    """After install(), `import transformer_engine` still fails outside the one Bridge module (HAVE_TE stays False)."""
    te_stub = no_finder
    if te_stub.te_available():
        pytest.skip("TransformerEngine is installed: the stand-in does nothing")
    assert te_stub.install() is True and te_stub.installed()
    assert te_stub.install() is True  # idempotent
    assert importlib.util.find_spec("transformer_engine") is None
    with pytest.raises(ImportError):
        import transformer_engine  # noqa: F401 - the import itself is what is tested


def test_bridge_outside_the_row_is_refused(no_finder, monkeypatch):
    """A megatron-bridge release the ledger row was not checked on fails install(), naming the row and release."""
    te_stub = no_finder
    if te_stub.te_available():
        pytest.skip("TransformerEngine is installed: the stand-in does nothing")
    from kimi_megatron_plugin import patches

    monkeypatch.setattr(patches, "host_release", lambda distribution: "0.7.0")
    monkeypatch.setattr(te_stub, "unguarded_module_spec", lambda name=None: importlib.util.find_spec("json"))
    with pytest.raises(PatchTargetError, match="'te_stub'.*megatron-bridge 0.7.0"):
        te_stub.install()
    assert not te_stub.installed()


def test_bridge_without_the_module_is_refused(no_finder, monkeypatch):
    """If the installed megatron-bridge no longer has the module the stand-in is scoped to, install() says which."""
    te_stub = no_finder
    if te_stub.te_available():
        pytest.skip("TransformerEngine is installed: the stand-in does nothing")
    from kimi_megatron_plugin import patches

    monkeypatch.setattr(patches, "host_release", lambda distribution: "0.6.2")
    monkeypatch.setattr(te_stub, "unguarded_module_spec", lambda name=None: None)
    with pytest.raises(PatchTargetError, match="te_stub.*megatron.bridge.peft.lora_layers"):
        te_stub.install()
