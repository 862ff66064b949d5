"""Bridge registration is guarded: without megatron-bridge it raises one error that says what to install."""

import pytest

from kimi_core.errors import PluginError


def test_register_without_bridge():
    """On the CPU lane (no megatron.bridge) register() names the extra to install; with it, K3 is registered."""
    from kimi_megatron_plugin import bridge

    if bridge.bridge_available():
        assert "KimiK3ForConditionalGeneration" in bridge.register()
    else:
        with pytest.raises(PluginError, match=r"kimi-megatron-plugin\[bridge\]"):
            bridge.register()
        assert bridge.registered_bridges() == {}


def test_importing_the_package_needs_no_bridge():
    """`from kimi_megatron_plugin import bridge` works on any node: megatron.bridge is imported only by register()."""
    import sys

    from kimi_megatron_plugin import bridge

    if not bridge.bridge_available():
        assert "megatron.bridge" not in sys.modules
