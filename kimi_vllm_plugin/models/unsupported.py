"""Stand-ins for the Kimi architectures the installed vLLM cannot host: construction raises one clear error.

:mod:`kimi_vllm_plugin.registration` points an architecture here (lazy string
``kimi_vllm_plugin.models.unsupported:Unsupported<Arch>``) when
:func:`kimi_vllm_plugin.host_support.host_report` says the installed vLLM cannot serve it, so vLLM
still starts and serves every other model, and a Kimi user reads why at model construction:
the release found, the releases supported and what to install.

Before construction vLLM inspects the class in a subprocess (``registry._ModelInfo.from_model_cls``:
``is_text_generation_model`` wants ``__init__(vllm_config=...)``, ``embed_input_ids``, ``forward(input_ids,
positions)`` and ``compute_logits``; 0.33 also refuses ``enable_lora`` before construction unless
``supports_lora``; ``supports_pp`` keeps pipeline-parallel runs from failing earlier with another
message). The stand-ins declare exactly that and nothing more: no multimodal or hybrid flags,
which would make vLLM build processors or state caches before it reaches construction.

For a ``model_type`` that an unsupported release does not know at all (``kimi_k3`` on 0.26,
``kimi_k31`` wherever K3.1 is unsupported) vLLM fails earlier, parsing ``config.json``; there
:func:`kimi_vllm_plugin.host_support.unsupported_config` raises the same message.
"""

from __future__ import annotations

import torch
from torch import nn

from kimi_vllm_plugin.host_support import PluginError, unsupported_message

__all__ = ["UnsupportedDeepseekV3ForCausalLM", "UnsupportedKimiK2ForCausalLM",
           "UnsupportedKimiK25ForConditionalGeneration", "UnsupportedKimiK3ForConditionalGeneration",
           "UnsupportedKimiK31ForConditionalGeneration"]

class _UnsupportedKimiModel(nn.Module):
    """Passes vLLM's registry inspection as a text-generation model; ``__init__`` raises :class:`PluginError`."""

    arch = ""
    supports_lora = True
    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}
    supports_pp = True

    def __init__(self, vllm_config=None, prefix: str = ""):
        raise PluginError(unsupported_message(self.arch))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # never reached: __init__ raises
        raise PluginError(unsupported_message(self.arch))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        raise PluginError(unsupported_message(self.arch))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise PluginError(unsupported_message(self.arch))

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        raise PluginError(unsupported_message(self.arch))


class UnsupportedDeepseekV3ForCausalLM(_UnsupportedKimiModel):
    """K2.x text on a vLLM outside its releases."""

    arch = "DeepseekV3ForCausalLM"


class UnsupportedKimiK2ForCausalLM(_UnsupportedKimiModel):
    """K2.x text (``KimiK2ForCausalLM`` name) on a vLLM outside its releases."""

    arch = "KimiK2ForCausalLM"


class UnsupportedKimiK25ForConditionalGeneration(_UnsupportedKimiModel):
    """K2.5 on a vLLM outside its releases."""

    arch = "KimiK25ForConditionalGeneration"


class UnsupportedKimiK3ForConditionalGeneration(_UnsupportedKimiModel):
    """K3 on a vLLM without the in-tree K3 (0.26) or outside its releases."""

    arch = "KimiK3ForConditionalGeneration"


class UnsupportedKimiK31ForConditionalGeneration(_UnsupportedKimiModel):
    """K3.1 on a vLLM without the in-tree K3 (0.26) or outside its releases."""

    arch = "KimiK31ForConditionalGeneration"

