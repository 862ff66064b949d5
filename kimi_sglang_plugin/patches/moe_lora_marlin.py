"""MoE LoRA on K3's MXFP4 + SiTU experts through SGLang's Marlin LoRA runner: the three hooks of ledger rows
``moe_lora_*``. Why each is needed and the pieces they put in place are in :mod:`kimi_sglang_plugin.moe_lora`.

* :func:`fused_moe_with_lora_init`: ``FusedMoEWithLoRA`` accepts an ``Mxfp4MoEMethod`` layer (through
  :class:`~kimi_sglang_plugin.moe_lora.Mxfp4MarlinQuantInfoAdapter`) and reads SiTU's ``gemm1_alpha`` as SiTU,
  not as GPT-OSS interleaved gate/up; K2.x INT4 layers are only checked.
* :func:`marlin_lora_run_from_dispatch`: a SiTU layer runs the stock Marlin LoRA core with its activation stage
  bound to SiTU; SiLU layers pass through.
* :func:`init_cuda_graph_moe_buffers` (0.5.17): the CUDA-graph buffer setup sees the Marlin layer's shapes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kimi_sglang_plugin.moe_lora import (
    MarlinShapeView,
    Mxfp4MarlinQuantInfoAdapter,
    check_int4_marlin,
    is_mxfp4_method,
    situ_activation_stage,
)

__all__ = ["fused_moe_with_lora_init", "marlin_lora_run_from_dispatch", "init_cuda_graph_moe_buffers"]

logger = logging.getLogger(__name__)
_LOGGED: set = set()


def fused_moe_with_lora_init(original, self, base_layer, lora_backend, *args, **kwargs):
    """AROUND ``FusedMoEWithLoRA.__init__`` (ledger ``moe_lora_mxfp4_quant_info``)."""
    method = base_layer.quant_method
    adapted = method is not None and is_mxfp4_method(method)
    if adapted:
        base_layer.quant_method = Mxfp4MarlinQuantInfoAdapter(method)
    else:
        check_int4_marlin(base_layer)
    try:
        original(self, base_layer, lora_backend, *args, **kwargs)
    finally:
        if adapted:
            base_layer.quant_method = method
    if adapted:
        self.quant_method = method
    rc = base_layer.moe_runner_config
    if rc.gemm1_alpha is not None and not getattr(rc, "gate_up_interleaved", True):
        self._uses_interleaved_gate_up = False
    return None


def marlin_lora_run_from_dispatch(original, core, dispatch_output, quant_info, runner_config, *args, **kwargs):
    """AROUND ``MarlinLoraRunnerCore.run_from_dispatch`` (ledger ``moe_lora_situ_stage``).

    Inputs/outputs are the stock ones: ``StandardDispatchOutput`` (hidden ``[M, K]`` bf16, top-k
    ``[M, k]``) -> ``StandardCombineInput`` (``[M, K]``). SiTU's ``beta`` / ``linear_beta`` are the
    runner config's ``gemm1_alpha`` / ``gemm1_clamp_limit`` (as K3's ``FusedMoE`` sets them).
    """
    if runner_config.activation != "situ":
        return original(core, dispatch_output, quant_info, runner_config, *args, **kwargs)
    if not runner_config.is_gated:
        raise ValueError("kimi_sglang_plugin: SiTU MoE LoRA needs gated experts (w1/w3)")
    beta, lin = runner_config.gemm1_alpha, runner_config.gemm1_clamp_limit
    if beta is None or lin is None:
        raise ValueError(
            "kimi_sglang_plugin: SiTU MoE layer without gemm1_alpha/gemm1_clamp_limit "
            "(activation_situ_beta / activation_situ_linear_beta in config.json)"
        )
    if "situ" not in _LOGGED:  # once per process: the GPU tests read it from SGLang's log
        _LOGGED.add("situ")
        logger.info(
            "kimi_sglang_plugin: MarlinLoraRunnerCore runs SiTU (beta=%s, linear_beta=%s) for MoE LoRA", beta, lin
        )
    as_silu = replace(runner_config, activation="silu")
    with situ_activation_stage(float(beta), float(lin)):
        return original(core, dispatch_output, quant_info, as_silu, *args, **kwargs)


def init_cuda_graph_moe_buffers(original, backend, max_bs, max_loras, compute_dtype, moe_layer, *args, **kwargs):
    """AROUND ``BaseLoRABackend.init_cuda_graph_moe_buffers`` (0.5.17; ledger ``moe_lora_cuda_graph_buffers``)."""
    qinfo = getattr(moe_layer, "_quant_info", None)
    if qinfo is not None and not hasattr(qinfo, "w13_weight") and hasattr(qinfo, "w13_qweight"):
        moe_layer = MarlinShapeView(moe_layer)
    return original(backend, max_bs, max_loras, compute_dtype, moe_layer, *args, **kwargs)
