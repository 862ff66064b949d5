"""MoE LoRA on K3's MXFP4 + SiTU experts through SGLang's Marlin LoRA runner: the three hooks of the rows in
:data:`ENTRIES`. Why each is needed and the pieces they put in place are in :mod:`kimi_sglang_plugin.moe_lora`.

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
from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, ONLY_0517, PR_37704, HookPatch

__all__ = ["ENTRIES", "fused_moe_with_lora_init", "marlin_lora_run_from_dispatch", "init_cuda_graph_moe_buffers"]

#: this file's ledger rows, in the order they are registered
ENTRIES: tuple[HookPatch, ...] = (
    HookPatch(
        name="moe_lora_marlin.quant_info",
        target="sglang.srt.lora.layers.FusedMoEWithLoRA.__init__",
        host=HOST,
        hook="around",
        fn=f"{__name__}:fused_moe_with_lora_init",
        why="with --moe-runner-backend marlin, FusedMoEWithLoRA asserts the quant method is "
        "CompressedTensorsFusedMoEMethod/ModelOptNvFp4FusedMoEMethod and calls get_marlin_quant_info, "
        "which Mxfp4MoEMethod lacks (PR #27930 closed); it also treats SiTU's gemm1_alpha as "
        "GPT-OSS interleaved gate/up",
        how="AROUND: for an Mxfp4MoEMethod layer, present a quant-info adapter during the stock __init__ "
        "(kimi_sglang_plugin.moe_lora.Mxfp4MarlinQuantInfoAdapter), restore the real quant method, clear the "
        "interleave flag for SiTU",
        upstream="sgl-project/sglang#27930 (closed), " + PR_37704,
        remove_when="Mxfp4MoEMethod exposes get_marlin_quant_info",
        versions=BOTH,
    ),
    HookPatch(
        name="moe_lora_marlin.situ_stage",
        target="sglang.srt.lora.lora_moe_runner_marlin.MarlinLoraRunnerCore.run_from_dispatch",
        host=HOST,
        hook="around",
        fn=f"{__name__}:marlin_lora_run_from_dispatch",
        why="MarlinLoraRunnerCore asserts activation == 'silu'; K3's experts are SiTU. 0.5.23 could take a "
        "registered runner core (register_moe_runner_core), but 0.5.17 has no registration point "
        "(moe_runner/runner.py:77 builds MarlinLoraRunnerCore directly), so one hook on the core's "
        "entry serves both",
        how="AROUND: SiLU layers pass through unchanged; a SiTU layer runs the stock core with its "
        "module-level silu_and_mul bound to SiTU (beta=gemm1_alpha, linear_beta=gemm1_clamp_limit) for "
        "that call and activation presented as silu; Marlin GEMMs, alignment, EP masks and LoRA hooks "
        "stay the stock core's",
        upstream="none (no SiTU in the Marlin LoRA core upstream)",
        remove_when="MarlinLoraRunnerCore supports activation 'situ'",
        versions=BOTH,
    ),
    HookPatch(
        name="moe_lora_marlin.cuda_graph_buffers",
        target="sglang.srt.lora.backend.base_backend.BaseLoRABackend.init_cuda_graph_moe_buffers",
        host=HOST,
        hook="around",
        fn=f"{__name__}:init_cuda_graph_moe_buffers",
        why="0.5.17 sizes the shared MoE LoRA CUDA-graph buffers from quant_info.w13_weight / w2_weight "
        "(lora/backend/base_backend.py:222); a Marlin quant info has w13_qweight / w2_qweight only, so "
        "Marlin MoE LoRA with CUDA graphs raises AttributeError at startup",
        how="AROUND: for a Marlin quant info, run the original on a view of the layer whose quant info "
        "exposes shape-only w13_weight [E, 2I, K] / w2_weight [E, K, I] (from the FusedMoE's own sizes) "
        "on the device of w13_qweight",
        upstream="fixed in 0.5.23 (reads w13_qweight, lora/backend/base_backend.py:306)",
        remove_when="0.5.17 is no longer supported",
        versions=ONLY_0517,
        absent_in="0.5.23: the buffers no longer depend on the weight shapes",
    ),
)

logger = logging.getLogger(__name__)
_LOGGED: set = set()


def fused_moe_with_lora_init(original, self, base_layer, lora_backend, *args, **kwargs):
    """AROUND ``FusedMoEWithLoRA.__init__`` (row ``moe_lora_marlin.quant_info``)."""
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
    """AROUND ``MarlinLoraRunnerCore.run_from_dispatch`` (row ``moe_lora_marlin.situ_stage``).

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
    """AROUND ``BaseLoRABackend.init_cuda_graph_moe_buffers`` (0.5.17; row ``moe_lora_marlin.cuda_graph_buffers``)."""
    qinfo = getattr(moe_layer, "_quant_info", None)
    if qinfo is not None and not hasattr(qinfo, "w13_weight") and hasattr(qinfo, "w13_qweight"):
        moe_layer = MarlinShapeView(moe_layer)
    return original(backend, max_bs, max_loras, compute_dtype, moe_layer, *args, **kwargs)
