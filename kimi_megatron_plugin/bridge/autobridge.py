"""Make Megatron-Bridge's ``AutoBridge`` resolve the Kimi architectures to this plugin's bridges.

megatron-bridge 0.6.2 ships K2 only as ``KimiK2ForCausalLM`` (released K2 configs say
``DeepseekV3ForCausalLM``, which it routes to its DeepSeek-V3 bridge) and K2.5 as a VL bridge; K3 and K3.1
it does not serve without TransformerEngine. :func:`register` registers every row of
:data:`kimi_megatron_plugin.registration.MODEL_CLASSES`:

* K3, K3.1, K2.5: ``MegatronModelBridge.register_bridge`` (replaces Bridge's own entry, if any: last one wins);
* K2 (``DeepseekV3ForCausalLM``): only the ``get_model_bridge`` lookup (what ``AutoBridge`` uses to load,
  build and export) is routed, and only for ``model_type == "kimi_k2"``; any other DeepSeek-V3 still gets
  Bridge's bridge. Bridge's ``(architecture, GPTModel)`` quantized-export dispatch
  (``export_hf_weights_quant``) still names its DeepSeek-V3 bridge for ``DeepseekV3ForCausalLM``.

Model types transformers does not know are registered with ``AutoConfig`` as plain ``PretrainedConfig``
subclasses, so ``AutoBridge.from_hf_pretrained`` reads the checkpoints without ``trust_remote_code``.
Without TransformerEngine, :mod:`kimi_megatron_plugin.patches.te_stub` lets Bridge import.
"""

from __future__ import annotations

import importlib
import importlib.util

from kimi_core.architectures import K2
from kimi_core.errors import PluginError
from kimi_megatron_plugin.host_support import MEGATRON_BRIDGE
from kimi_megatron_plugin.registration import MODEL_CLASSES, MODEL_TYPES

__all__ = ["bridge_available", "import_bridge", "register", "registered_bridges"]

_REGISTERED: dict[str, type] = {}


def import_bridge():
    """``megatron.bridge``, imported with the ``te_stub`` patch when TransformerEngine is absent.

    :raises PluginError: megatron-bridge is not installed (names the extra to install).
    """
    if not bridge_available():
        raise PluginError(f"kimi_megatron_plugin.bridge: {MEGATRON_BRIDGE.refusal('no megatron-bridge')}")
    from kimi_megatron_plugin.patches import te_stub

    te_stub.install()
    import megatron.bridge

    return megatron.bridge


def bridge_available() -> bool:
    """Whether megatron-bridge is installed (found without importing it; a broken install fails in
    :func:`import_bridge`, loudly)."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None


def _resolve(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _register_hf_configs() -> None:
    """``AutoConfig`` entries for the Kimi model types transformers lacks.

    ``kimi_k2`` is a DeepSeek-V3 text config (its YaRN ``rope_scaling`` needs DeepseekV3Config's rope
    handling); the nested VL configs are plain attribute bags (our loader reads ``config.json`` itself).
    """
    from transformers import AutoConfig, DeepseekV3Config, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in sorted(set(MODEL_TYPES.values())):
        if model_type in CONFIG_MAPPING:
            continue
        base = DeepseekV3Config if model_type == MODEL_TYPES[K2] else PretrainedConfig
        cls = type(
            f"{model_type.title().replace('_', '')}HFConfig",
            (base,),
            {"model_type": model_type, "__module__": __name__},
        )
        AutoConfig.register(model_type, cls)


def _model_type(hf_config) -> str | None:
    cfg = getattr(hf_config, "config", hf_config)
    return getattr(cfg, "model_type", None) if cfg is not None else None


def _register_k2(bridge_cls: type) -> None:
    """Route ``DeepseekV3ForCausalLM`` with ``model_type == "kimi_k2"`` to ``bridge_cls``, the rest as before."""
    import transformers
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    key = getattr(transformers, K2, K2)
    # the dispatch table AutoBridge itself reads (list_supported_models / _validate_config)
    previous = get_model_bridge._exact_types.get(key) or get_model_bridge._exact_types.get(K2)
    if getattr(previous, "_kimi_k2_router", False):
        return

    def route(arch, hf_config=None):
        if _model_type(hf_config) == MODEL_TYPES[K2]:
            bridge = bridge_cls()
            if hf_config is not None:
                bridge.hf_pretrained = hf_config
                bridge.hf_config = getattr(hf_config, "config", hf_config)
            return bridge
        if previous is None:
            raise NotImplementedError(
                f"{K2} with model_type {_model_type(hf_config)!r}: megatron-bridge has no bridge for it and "
                f"kimi_megatron_plugin serves only model_type {MODEL_TYPES[K2]}"
            )
        return previous(arch, hf_config)

    route._kimi_k2_router = True
    get_model_bridge.impl(key)(route)


def register(force: bool = False) -> dict[str, str]:
    """Idempotent: make the Kimi architectures known to Megatron-Bridge; returns ``{architecture: model_type}``.

    ``force``: register again even if this process already did. Bridge's registry is last-write-wins, so a host
    that registers its own bridge for a Kimi architecture after us (SkyRL's Megatron worker module does, at
    import) is overridden only by a later, forced call.

    Example::

        from kimi_megatron_plugin import bridge, cpu_parallel
        bridge.register()
        from megatron.bridge import AutoBridge
        cpu_parallel.initialize_cpu_parallel()
        auto = AutoBridge.from_hf_pretrained("/ckpt/Kimi-K3")
        model = auto.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)  # loaded

    :raises PluginError: megatron-bridge is absent (names the extra to install).
    """
    if _REGISTERED and not force:
        return dict(MODEL_TYPES)
    import_bridge()
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.core.models.gpt import GPTModel

    from kimi_megatron_plugin.bridge.provider import KimiBridgeProvider

    _register_hf_configs()
    for arch, target in MODEL_CLASSES.items():
        cls = _resolve(target)
        if arch == K2:
            _register_k2(cls)
        else:
            MegatronModelBridge.register_bridge(
                source=arch, target=GPTModel, provider=KimiBridgeProvider, model_type=MODEL_TYPES[arch]
            )(cls)
        _REGISTERED[arch] = cls
    return dict(MODEL_TYPES)


def registered_bridges() -> dict[str, type]:
    """``{architecture: bridge class}`` registered by :func:`register` (empty before)."""
    return dict(_REGISTERED)
