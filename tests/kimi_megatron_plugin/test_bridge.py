"""Bridge registration is guarded: without megatron-bridge it raises one error that says what to install."""

import pytest


def test_register_without_bridge():
    """On the CPU lane (no megatron.bridge) register() names the extra to install."""
    from kimi_megatron_plugin import bridge

    if bridge.bridge_available():
        assert "KimiK3ForConditionalGeneration" in bridge.register()
    else:
        with pytest.raises(bridge.BridgeUnavailableError, match=r"kimi-rl-plugins\[bridge\]"):
            bridge.register()
