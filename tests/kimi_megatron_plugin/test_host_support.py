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
