"""SkyRL's Megatron worker (skyrl 0.4.0, ``init_configs``) accepts a ``kimi_k25`` checkpoint with ``language_model_only``
only when Bridge's chosen bridge class is named ``KimiK25TextBridge``: ours is, and it is ours (a Kimi bridge)."""

from __future__ import annotations

from py312_lane import require

require("megatron.bridge", "megatron-bridge==0.6.2")
from kimi_megatron_plugin import bridge as kimi_bridge

kimi_bridge.register()
from megatron.bridge import AutoBridge

from kimi_megatron_plugin.bridge.model_bridge import KimiBridge


def test_k25_bridge_passes_skyrls_name_check(tiny_ckpt):
    chosen = AutoBridge.from_hf_pretrained(tiny_ckpt("k25", layers=3))._model_bridge
    assert type(chosen).__name__ == "KimiK25TextBridge" and isinstance(chosen, KimiBridge)
