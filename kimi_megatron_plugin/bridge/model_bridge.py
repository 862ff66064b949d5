"""The Megatron-Bridge bridges of the Kimi architectures: one ``MegatronModelBridge`` and a subclass per architecture.

Nothing here converts weights or translates configs itself:

* :meth:`KimiBridge.provider_bridge` returns a :class:`~kimi_megatron_plugin.bridge.provider.KimiBridgeProvider`
  (our model provider with Bridge's contract);
* :meth:`KimiBridge.mapping_registry` is :func:`kimi_megatron_plugin.bridge.param_mapping.build_mapping_registry`,
  i.e. :data:`kimi_megatron_plugin.mapping.RULES`;
* :meth:`KimiBridge.maybe_modify_loaded_hf_weight` dequantizes routed experts for the ``qat`` / ``dense``
  modes with :mod:`kimi_core.quant` (``w4a16`` keeps the packed bytes).

Only the text model is built (``language_model_only``, as SkyRL's K2.5 text bridge); a VL release's
``vision_tower.*`` / ``mm_projector.*`` tensors are left unmapped. The per-architecture subclasses are what
:data:`kimi_megatron_plugin.registration.MODEL_CLASSES` names; :func:`kimi_megatron_plugin.bridge.register`
registers them; they are reached as attributes of :mod:`kimi_megatron_plugin.bridge`, which imports this module
through :func:`kimi_megatron_plugin.bridge.import_bridge` (megatron-bridge with the ``te_stub`` patch).
"""

from __future__ import annotations

import os

import torch
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

from kimi_core.architectures import K2
from kimi_core.config import KimiConfig, load_config
from kimi_core.quant import get_format
from kimi_megatron_plugin.bridge.param_mapping import build_mapping_registry
from kimi_megatron_plugin.bridge.provider import KimiBridgeProvider
from kimi_megatron_plugin.registration import MODEL_TYPES

__all__ = ["KimiBridge", "KimiK3Bridge", "KimiK31Bridge", "KimiK25TextBridge", "KimiK2TextBridge", "kimi_config_of"]


def kimi_config_of(hf) -> KimiConfig:
    """:class:`KimiConfig` of a Bridge ``hf_pretrained`` (wrapper or ``PretrainedConfig``).

    Reads ``config.json`` from the local checkpoint directory when there is one (the exact file our
    loader validates); otherwise parses the config object's ``to_dict()``.
    """
    path = getattr(hf, "model_name_or_path", None) or getattr(getattr(hf, "config", hf), "name_or_path", None)
    if path and os.path.isfile(os.path.join(str(path), "config.json")):
        return load_config(path)
    cfg = hf.config if hasattr(hf, "config") else hf
    return KimiConfig.from_hf(cfg.to_dict(), where=f"{type(cfg).__name__} ({path or 'no path'})")


class KimiBridge(MegatronModelBridge):
    """Bridge of one Kimi architecture (the subclasses below name which)."""

    PROVIDER_CLASS = KimiBridgeProvider

    def _kimi(self) -> KimiConfig:
        src = getattr(self, "hf_pretrained", None) or getattr(self, "hf_config", None)
        if src is None:
            raise ValueError(f"{type(self).__name__}: no HF config attached (use AutoBridge.from_hf_pretrained)")
        return kimi_config_of(src)

    def provider_bridge(self, hf_pretrained) -> KimiBridgeProvider:
        return KimiBridgeProvider(kimi=kimi_config_of(hf_pretrained))

    def mapping_registry(self):
        return build_mapping_registry(self._kimi())

    def maybe_modify_loaded_hf_weight(self, hf_param, hf_state_dict):
        """Expert masters for ``qat`` / ``dense``: ``<module>.weight_packed`` + ``.weight_scale`` dequantized (fp32)."""
        # only KimiExpertStackMapping(kind="weight") names bare modules: ``...experts.<e>.<proj>``
        if not (
            isinstance(hf_param, dict)
            and hf_param
            and all(
                ".experts." in v and not v.endswith((".weight", "weight_packed", "weight_scale"))
                for v in hf_param.values()
            )
        ):
            return super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict)
        kimi = self._kimi()
        out = {}
        for k, module in hf_param.items():
            if f"{module}.weight_packed" in hf_state_dict:
                if f"{module}.weight_scale" not in hf_state_dict:
                    raise KeyError(f"quantized weight {module!r} is missing {module}.weight_scale")
                fmt = get_format(kimi.quant.format)
                out[k] = fmt.dequantize(
                    hf_state_dict[f"{module}.weight_packed"], hf_state_dict[f"{module}.weight_scale"], torch.float32
                )
            else:
                out[k] = hf_state_dict[f"{module}.weight"]
        return out


class KimiK3Bridge(KimiBridge):
    """``KimiK3ForConditionalGeneration`` (text model)."""


class KimiK31Bridge(KimiBridge):
    """``KimiK31ForConditionalGeneration`` (text model, with the DSA indexer)."""


class KimiK25TextBridge(KimiBridge):
    """``KimiK25ForConditionalGeneration`` (text model).

    Named as SkyRL's own K2.5 text bridge: SkyRL's Megatron worker (skyrl 0.4.0, ``init_configs``) refuses a
    ``kimi_k25`` checkpoint with ``language_model_only`` unless ``type(bridge._model_bridge).__name__`` is
    ``"KimiK25TextBridge"``, so this class passes that check where ``kimi_rl_glue.skyrl`` registers it."""


class KimiK2TextBridge(KimiBridge):
    """``DeepseekV3ForCausalLM`` with ``model_type`` ``kimi_k2``; routed by
    :func:`kimi_megatron_plugin.bridge.register` instead of ``register_bridge`` (see there)."""

    SOURCE_NAME = K2
    MODEL_TYPE = MODEL_TYPES[K2]
