"""What this plugin registers with its host, as data: HF architecture -> the class that serves it.

Megatron-Core itself has no model registry: miles and raw megatron-core take the model from
``--spec kimi_megatron_plugin.spec get_spec`` and checkpoints from :mod:`kimi_megatron_plugin.checkpoint`.
Megatron-Bridge's ``AutoBridge`` has one: :func:`kimi_megatron_plugin.bridge.register` registers every row
of :data:`MODEL_CLASSES` there, so ``AutoBridge.from_hf_pretrained`` builds our provider (native 4-bit HF
checkpoint in, HF names out). The values are lazy ``"module:Class"`` strings: reading this table imports
neither megatron-core nor megatron-bridge, and resolving a value works on any node (without megatron-bridge
it gives a stand-in whose construction says what to install).

The K2 row is special: released K2 configs say ``DeepseekV3ForCausalLM``, which Bridge routes to its own
DeepSeek-V3 bridge, so only checkpoints whose ``model_type`` is ``kimi_k2`` are routed to ours
(:data:`MODEL_TYPES`); any other DeepSeek-V3 keeps Bridge's bridge.
"""

from __future__ import annotations

from kimi_core.architectures import K2, K3, K25, K31

__all__ = ["MODEL_CLASSES", "MODEL_TYPES"]

# the bridge classes are attributes of the bridge package: model_bridge's with megatron-bridge installed,
# refusal stand-ins (construction raises what to install) without it, so resolving a row never fails
_BRIDGES = "kimi_megatron_plugin.bridge"

#: HF architecture -> ``"module:Class"`` of the Megatron-Bridge bridge that serves it
MODEL_CLASSES: dict[str, str] = {
    K3: f"{_BRIDGES}:KimiK3Bridge",
    K31: f"{_BRIDGES}:KimiK31Bridge",
    K25: f"{_BRIDGES}:KimiK25TextBridge",
    K2: f"{_BRIDGES}:KimiK2TextBridge",
}

#: HF architecture -> the ``config.json`` ``model_type`` Bridge registers (and, for K2, the one routed to us)
MODEL_TYPES: dict[str, str] = {K3: "kimi_k3", K31: "kimi_k31", K25: "kimi_k25", K2: "kimi_k2"}
