"""Megatron-Bridge support: the Kimi architectures in ``AutoBridge``, with our provider and our one name table.

========================  =================================================================================
module                    role
========================  =================================================================================
``autobridge``            :func:`register` (idempotent), :func:`import_bridge`, :func:`bridge_available`
``model_bridge``          ``KimiBridge`` (a ``MegatronModelBridge``) and one subclass per architecture
``provider``              ``KimiBridgeProvider``: our model provider with Bridge's provider contract
``param_mapping``         Bridge's ``MegatronMappingRegistry`` generated from :data:`kimi_megatron_plugin.
                          mapping.RULES` (no second name table)
========================  =================================================================================

This package imports neither megatron-core nor megatron-bridge until :func:`register` runs, so
``from kimi_megatron_plugin import bridge`` works on any node; ``model_bridge``, ``provider`` and
``param_mapping`` need megatron-bridge (import them after :func:`import_bridge`).
"""

from kimi_megatron_plugin.bridge.autobridge import bridge_available, import_bridge, register, registered_bridges

__all__ = ["bridge_available", "import_bridge", "register", "registered_bridges"]
