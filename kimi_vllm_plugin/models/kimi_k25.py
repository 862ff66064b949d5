"""Kimi K2.5 / K2.6 (``KimiK25ForConditionalGeneration``) with LoRA; serve text-only with
``language_model_only=True`` (``--language-model-only``), the SkyRL recipe's setting.

Upstream builds its text model as the in-tree ``DeepseekV2ForCausalLM`` (no MoE LoRA on the
CPU, no Kimi expert mapping). Here the text model is our
:class:`~kimi_vllm_plugin.models.deepseek_v3.KimiDeepseekV3ForCausalLM`, selected through the
``k25_text_model`` patch (:mod:`kimi_vllm_plugin.patches.k25_text_model`), and the wrapper carries
every ``SupportsLoRA`` member (upstream's is not LoRA-capable: vllm-project/vllm#43840).
"""

from __future__ import annotations

from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

from kimi_core.architectures import K2
from kimi_vllm_plugin.models.lora_interface import KimiLoRAMixin

__all__ = ["KimiK25LoRAForConditionalGeneration", "TEXT_ARCH"]

#: registry name our K2.x text class is registered under (registration.MODEL_CLASSES)
TEXT_ARCH = K2


class KimiK25LoRAForConditionalGeneration(KimiLoRAMixin, KimiK25ForConditionalGeneration):
    """LoRA-capable K2.5. Adapter names: ``language_model.model.layers.{l}...`` (HF names)."""

    packed_modules_mapping = {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    }

    def __init__(self, vllm_config, prefix: str = ""):
        from kimi_vllm_plugin.patches import lora_dir_prepare
        from kimi_vllm_plugin.patches.k25_text_model import text_model_arch

        self.packed_modules_mapping = {k: list(v) for k, v in type(self).packed_modules_mapping.items()}
        import vllm.model_executor.models.kimi_k25 as k25

        with text_model_arch(k25, "DeepseekV2ForCausalLM", TEXT_ARCH):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._add_expert_lora_names()
        lora_dir_prepare.mark_model(self, vllm_config)  # the text model's build installed the patch
