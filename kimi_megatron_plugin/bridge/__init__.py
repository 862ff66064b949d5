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

This package imports neither megatron-core nor megatron-bridge until a bridge class or :func:`register` is
asked for, so ``from kimi_megatron_plugin import bridge`` works on any node. The bridge classes
(:data:`BRIDGE_CLASSES`, what :data:`kimi_megatron_plugin.registration.MODEL_CLASSES` names) are attributes of
this package: with megatron-bridge installed, ``model_bridge``'s classes (imported through :func:`import_bridge`,
so the ``te_stub`` patch is in place); without it, refusal stand-ins whose construction raises one
:class:`kimi_core.errors.PluginError` saying what to install.
"""

from kimi_megatron_plugin.bridge.autobridge import bridge_available, import_bridge, register, registered_bridges

__all__ = ["BRIDGE_CLASSES", "bridge_available", "import_bridge", "register", "registered_bridges"]

#: the classes of :mod:`kimi_megatron_plugin.bridge.model_bridge` reachable as attributes of this package
BRIDGE_CLASSES = ("KimiBridge", "KimiK3Bridge", "KimiK31Bridge", "KimiK25TextBridge", "KimiK2TextBridge")


def __getattr__(name: str):
    if name not in BRIDGE_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not bridge_available():
        from kimi_megatron_plugin.host_support import MEGATRON_BRIDGE, refusal_class

        return refusal_class(name, MEGATRON_BRIDGE, "no megatron-bridge")
    import_bridge()
    from kimi_megatron_plugin.bridge import model_bridge

    return getattr(model_bridge, name)
