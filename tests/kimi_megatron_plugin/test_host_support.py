"""The megatron-core gate is data and loud: releases outside the table are refused with what to install."""

from __future__ import annotations

import pytest

from kimi_core.errors import PluginError


@pytest.mark.parametrize("version,ok", [("0.16.1", True), ("0.19.2", True), ("0.16.0", False), ("0.20.0", False)])
def test_version_gate(version, ok):
    """megatron-core outside [0.16.1, 0.20) raises a PluginError that names the release found and what to install."""
    from kimi_megatron_plugin.host_support import check_mcore_version

    if ok:
        assert str(check_mcore_version(version)) == version
    else:
        with pytest.raises(PluginError, match=rf"found megatron-core {version}.*megatron-core==0\.16\.1"):
            check_mcore_version(version)


def test_installed_release_is_supported():
    """The lane's own megatron-core is inside the table (what the test venvs install)."""
    pytest.importorskip("megatron.core")
    from kimi_megatron_plugin.host_support import MEGATRON_CORE, check_mcore_version, host_release

    assert MEGATRON_CORE.accepts(check_mcore_version())
    assert host_release("megatron-core") == str(check_mcore_version())


def test_absent_host_has_no_release():
    """host_release says None for a distribution that is not installed, instead of raising."""
    from kimi_megatron_plugin.host_support import host_release

    assert host_release("kimi-no-such-distribution") is None


def test_fork_release_string_alone_is_refused():
    """0.16.0rc0 without the fork's tree (this lane's megatron-core is a release) is refused, and the message names
    the fork that is accepted."""
    from kimi_megatron_plugin.host_support import check_mcore_version

    with pytest.raises(
        PluginError, match=r"radixark/Megatron-LM miles-main \(reports 0\.16\.0rc0\).*found megatron-core"
    ):
        check_mcore_version("0.16.0rc0")


def test_fork_needs_its_version_and_every_marker(monkeypatch):
    """MILES_MEGATRON_FORK matches only its exact release string with all marker modules findable."""
    import importlib.util

    from kimi_megatron_plugin import host_support as hs

    fork = hs.MILES_MEGATRON_FORK
    present = set(fork.markers)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in present else None)
    assert fork.matches("0.16.0rc0") and hs.MEGATRON_CORE.accepts("0.16.0rc0")
    assert str(hs.check_mcore_version("0.16.0rc0")) == "0.16.0rc0"
    assert not fork.matches("0.16.0rc1") and not fork.matches("0.16.0")
    present.discard(fork.markers[0])
    assert not fork.matches("0.16.0rc0")


def test_ledger_range_covers_releases_and_fork():
    """The patch ledger's range holds the supported releases and the fork's, and not what lies outside."""
    from packaging.specifiers import SpecifierSet

    from kimi_megatron_plugin.host_support import MEGATRON_CORE

    rng = SpecifierSet(MEGATRON_CORE.ledger_releases)
    assert all(v in rng for v in ("0.16.0rc0", "0.16.1", "0.19.2"))
    assert "0.20.0" not in rng and "0.15.3" not in rng
