"""The Megatron-Bridge classes of the Kimi architectures: a ``MegatronModelBridge`` and its model provider.

Imported only by :func:`kimi_megatron_plugin.bridge.register` (after
:func:`kimi_megatron_plugin.te_stub.install`); it needs megatron-bridge 0.6.x. Nothing here
converts weights or translates configs itself:

* :meth:`KimiBridge.provider_bridge` returns a :class:`KimiBridgeProvider`, which *is* our
  :class:`~kimi_megatron_plugin.provider.KimiModelProvider` (same config translation, same block
  spec, same W4A16 / QAT / dense experts) plus Bridge's ``ModelProviderMixin`` contract
  (``provide``, ``finalize``, ``provide_distributed_model``, pre-wrap hooks);
* :meth:`KimiBridge.mapping_registry` is :func:`kimi_megatron_plugin.bridge_mapping.build_mapping_registry`,
  i.e. :data:`kimi_megatron_plugin.mapping.RULES`;
* :meth:`KimiBridge.maybe_modify_loaded_hf_weight` dequantizes routed experts for the ``qat`` /
  ``dense`` modes with :mod:`kimi_core.quant` (``w4a16`` keeps the packed bytes).

Only the text model is built (``language_model_only``, as SkyRL's K2.5 text bridge); a VL
release's ``vision_tower.*`` / ``mm_projector.*`` tensors are left unmapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.model_provider import ModelProviderMixin

from kimi_core.config import KimiConfig, load_config
from kimi_core.quant import get_format
from kimi_megatron_plugin.bridge_mapping import build_mapping_registry
from kimi_megatron_plugin.provider import KimiModelProvider, build_model, transformer_config

__all__ = ["KimiBridge", "KimiBridgeProvider", "kimi_config_of"]


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


@dataclass
class KimiBridgeProvider(KimiModelProvider, ModelProviderMixin):
    """:class:`KimiModelProvider` with Bridge's provider contract.

    The megatron config is built in :meth:`finalize` (not at construction: Bridge creates the
    provider before model parallelism is initialised) from the parallel sizes set on the provider,
    the attribute names Bridge's ``initialize_model_parallel`` reads.

    :param params_dtype: fp32 (numerics checks, default) or bf16 (training).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    params_dtype: torch.dtype = torch.float32
    perform_initialization: bool = True

    def __post_init__(self):
        pass  # deferred to finalize()

    def finalize(self) -> None:
        self.config = transformer_config(
            self.kimi, tensor_parallel=self.tensor_model_parallel_size,
            pipeline_parallel=self.pipeline_model_parallel_size, expert_parallel=self.expert_model_parallel_size,
            params_dtype=self.params_dtype, perform_initialization=self.perform_initialization)

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        """This rank's ``GPTModel`` chunk (:func:`kimi_megatron_plugin.provider.build_model`)."""
        if self.config is None:
            self.finalize()
        return build_model(self.kimi, self.config, pre_process, post_process, vp_stage, self.expert_mode,
                           **self.expert_kwargs)

    __call__ = provide


class KimiBridge(MegatronModelBridge):
    """Bridge of one Kimi architecture; :func:`kimi_megatron_plugin.bridge.register` subclasses it per architecture."""

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
        if not (isinstance(hf_param, dict) and hf_param and all(
                ".experts." in v and not v.endswith((".weight", "weight_packed", "weight_scale"))
                for v in hf_param.values())):
            return super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict)
        kimi = self._kimi()
        out = {}
        for k, module in hf_param.items():
            if f"{module}.weight_packed" in hf_state_dict:
                if f"{module}.weight_scale" not in hf_state_dict:
                    raise KeyError(f"quantized weight {module!r} is missing {module}.weight_scale")
                fmt = get_format(kimi.quant.format)
                out[k] = fmt.dequantize(hf_state_dict[f"{module}.weight_packed"],
                                        hf_state_dict[f"{module}.weight_scale"], torch.float32)
            else:
                out[k] = hf_state_dict[f"{module}.weight"]
        return out
