"""Megatron-Bridge registration of the Kimi architectures (only where megatron-bridge is importable).

megatron-bridge 0.6.2 (Python 3.12) ships K2 only as ``KimiK2ForCausalLM`` (released K2 configs say
``DeepseekV3ForCausalLM``, which it routes to its DeepSeek-V3 bridge) and K2.5 as a VL bridge; K3 is
on its ``main`` branch, TransformerEngine-only; K3.1 is nowhere. :func:`register` makes
``AutoBridge`` resolve every architecture below to :class:`~kimi_megatron_plugin.bridge_impl.KimiBridge`,
whose provider and name table are this plugin's (native 4-bit HF checkpoint in, HF names out):

=================================  ===========  ==================================================
architecture                       model_type   how
=================================  ===========  ==================================================
``KimiK3ForConditionalGeneration``  ``kimi_k3``  ``MegatronModelBridge.register_bridge`` (replaces
``KimiK31ForConditionalGeneration`` ``kimi_k31`` Bridge's own entry, if any: last one wins)
``KimiK25ForConditionalGeneration`` ``kimi_k25``
``DeepseekV3ForCausalLM``           ``kimi_k2``  only when ``config.model_type == "kimi_k2"``; any
                                                other DeepSeek-V3 still gets Bridge's bridge
=================================  ===========  ==================================================

For K2 only the ``get_model_bridge`` lookup (what ``AutoBridge`` uses to load, build and export) is
routed; Bridge's ``(architecture, GPTModel)`` quantized-export dispatch (``export_hf_weights_quant``)
still names its DeepSeek-V3 bridge for ``DeepseekV3ForCausalLM``.

Model types transformers does not know are registered with ``AutoConfig`` as plain
``PretrainedConfig`` subclasses, so ``AutoBridge.from_hf_pretrained`` can read the checkpoints
without ``trust_remote_code``. Without TransformerEngine, :mod:`kimi_megatron_plugin.te_stub`
lets Bridge import. Example::

    from kimi_megatron_plugin import bridge, cpu_compat
    bridge.register()
    from megatron.bridge import AutoBridge
    cpu_compat.initialize_cpu_parallel()
    auto = AutoBridge.from_hf_pretrained("/ckpt/Kimi-K3")
    model = auto.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)  # loaded
"""

from __future__ import annotations

from kimi_core.errors import KimiError

ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "KimiK31ForConditionalGeneration": "kimi_k31",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "DeepseekV3ForCausalLM": "kimi_k2",  # K2.x text: architectures DeepseekV3ForCausalLM, model_type kimi_k2
}
K2_ARCHITECTURE = "DeepseekV3ForCausalLM"

_REGISTERED: dict[str, type] = {}

__all__ = ["ARCHITECTURES", "BridgeUnavailableError", "bridge_available", "import_bridge", "register",
           "registered_bridges"]


class BridgeUnavailableError(KimiError, ImportError):
    """megatron-bridge is not installed (it needs Python 3.12)."""


INSTALL_HINT = ("kimi_megatron_plugin.bridge: megatron-bridge is not installed; pip install "
                "'kimi-rl-plugins[bridge]' (megatron-bridge==0.6.2, Python 3.12). Without Bridge, load native "
                "checkpoints with kimi_megatron_plugin.checkpoint.load_hf_checkpoint.")


def import_bridge():
    """``megatron.bridge`` (with :mod:`.te_stub` when TE is absent); :class:`BridgeUnavailableError` if missing."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        raise BridgeUnavailableError(INSTALL_HINT)
    from kimi_megatron_plugin import te_stub

    te_stub.install()
    import megatron.bridge

    return megatron.bridge


def bridge_available() -> bool:
    try:
        import_bridge()
    except ImportError:
        return False
    return True


def _register_hf_configs() -> None:
    """``AutoConfig`` entries for the Kimi model types transformers lacks.

    ``kimi_k2`` is a DeepSeek-V3 text config (its YaRN ``rope_scaling`` needs DeepseekV3Config's rope
    handling); the nested VL configs are plain attribute bags (our loader reads ``config.json`` itself).
    """
    from transformers import AutoConfig, DeepseekV3Config, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in sorted(set(ARCHITECTURES.values())):
        if model_type in CONFIG_MAPPING:
            continue
        base = DeepseekV3Config if model_type == "kimi_k2" else PretrainedConfig
        cls = type(f"{model_type.title().replace('_', '')}HFConfig", (base,),
                   {"model_type": model_type, "__module__": __name__})
        AutoConfig.register(model_type, cls)


def _model_type(hf_config) -> str | None:
    cfg = getattr(hf_config, "config", hf_config)
    return getattr(cfg, "model_type", None) if cfg is not None else None


def _register_k2(bridge_cls: type) -> None:
    """Route ``DeepseekV3ForCausalLM`` with ``model_type == "kimi_k2"`` to ``bridge_cls``, the rest as before."""
    import transformers
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    key = getattr(transformers, K2_ARCHITECTURE, K2_ARCHITECTURE)
    # the dispatch table AutoBridge itself reads (list_supported_models / _validate_config)
    previous = get_model_bridge._exact_types.get(key) or get_model_bridge._exact_types.get(K2_ARCHITECTURE)
    if getattr(previous, "_kimi_k2_router", False):
        return

    def route(arch, hf_config=None):
        if _model_type(hf_config) == "kimi_k2":
            bridge = bridge_cls()
            if hf_config is not None:
                bridge.hf_pretrained = hf_config
                bridge.hf_config = getattr(hf_config, "config", hf_config)
            return bridge
        if previous is None:
            raise NotImplementedError(f"{K2_ARCHITECTURE} with model_type {_model_type(hf_config)!r}: megatron-bridge "
                                      "has no bridge for it and kimi_megatron_plugin serves only model_type kimi_k2")
        return previous(arch, hf_config)

    route._kimi_k2_router = True
    get_model_bridge.impl(key)(route)


def register() -> dict[str, str]:
    """Idempotent: make the Kimi architectures known to Megatron-Bridge; returns ``{architecture: model_type}``.

    :raises BridgeUnavailableError: megatron-bridge is absent (names the extra to install).
    """
    if _REGISTERED:
        return dict(ARCHITECTURES)
    import_bridge()
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.core.models.gpt import GPTModel

    from kimi_megatron_plugin.bridge_impl import KimiBridge, KimiBridgeProvider

    _register_hf_configs()
    for arch, model_type in ARCHITECTURES.items():
        name = "KimiK2TextBridge" if arch == K2_ARCHITECTURE else arch.replace("ForConditionalGeneration", "Bridge")
        cls = type(name, (KimiBridge,), {"__module__": "kimi_megatron_plugin.bridge_impl"})
        if arch == K2_ARCHITECTURE:
            cls.SOURCE_NAME, cls.MODEL_TYPE, cls.PROVIDER_CLASS = arch, model_type, KimiBridgeProvider
            _register_k2(cls)
        else:
            MegatronModelBridge.register_bridge(source=arch, target=GPTModel, provider=KimiBridgeProvider,
                                                model_type=model_type)(cls)
        _REGISTERED[arch] = cls
    return dict(ARCHITECTURES)


def registered_bridges() -> dict[str, type]:
    """``{architecture: bridge class}`` registered by :func:`register` (empty before)."""
    return dict(_REGISTERED)
