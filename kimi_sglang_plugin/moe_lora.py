"""MoE LoRA on Kimi's 4-bit routed experts in SGLang 0.5.23: K3/K3.1 MXFP4 + SiTU, K2.x INT4.

Which mechanism, and why (reference/sglang.md section 3). With ``--moe-runner-backend marlin``
(the K3 H200 recipe) ``FusedMoEWithLoRA`` builds ``MoeRunner(MARLIN, lora_enabled=True)``, whose
core is ``MarlinLoraRunnerCore``: Marlin gate_up GEMM -> LoRA hook -> ``silu_and_mul`` -> Marlin
down GEMM -> LoRA hook -> sum. Two things stop K3:

1. ``FusedMoEWithLoRA.__init__`` asserts the quant method is a compressed-tensors or ModelOpt
   method and calls ``get_marlin_quant_info``; ``Mxfp4MoEMethod`` has neither (PR #27930 closed),
   although ``mxfp4_marlin_moe.build_marlin_moe_quant_info(layer)`` builds exactly that payload.
2. ``MarlinLoraRunnerCore`` asserts ``activation == "silu"``; K3 experts use SiTU.

A quant-info adapter alone fixes (1) but not (2); a runner core alone fixes (2) but never gets
the MXFP4 weights. So both, each minimal:

* :class:`Mxfp4MarlinQuantInfoAdapter` (installed by the :func:`fused_moe_with_lora_init` hook) hands
  the stock constructor ``build_marlin_moe_quant_info(layer)``; the real quant method is restored
  right after, so the base (non-LoRA) path is untouched.
* :class:`KimiMarlinLoraRunnerCore`, registered for the ``marlin`` backend through
  ``register_moe_runner_core`` (only LoRA runners build a core for marlin; the base path keeps
  its fused function). SiLU layers (K2.x INT4) go to the stock core unchanged. SiTU layers run
  the same stock core with the activation stage bound to SiTU: the Marlin GEMMs, expert
  alignment, EP masking and LoRA hooks stay upstream's, single-sourced; only stage 2 differs.

The same hook fixes a sixth K3 bug: ``FusedMoEWithLoRA`` infers GPT-OSS interleaved gate/up
from ``gemm1_alpha``, which K3 sets for SiTU's beta although its w13 is not interleaved
(``gate_up_interleaved=False``); the LoRA gate_up ``B`` would be row-shuffled.

K2.x INT4 (``pack-quantized``, scheme ``CompressedTensorsWNA16MoE``) already exposes
``get_marlin_quant_info``; :func:`check_int4_marlin` only validates the pairing and names the
flag to change. Everything here that launches kernels needs a GPU (SM90+ for MXFP4 Marlin).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

__all__ = [
    "SITU_RUNNER_BACKEND", "KimiMarlinLoraRunnerCore", "Mxfp4MarlinQuantInfoAdapter", "check_int4_marlin",
    "fused_moe_with_lora_init", "register_runner_core", "situ_and_mul_torch",
]

logger = logging.getLogger(__name__)

#: the built-in backend name our core is registered for
SITU_RUNNER_BACKEND = "marlin"


def situ_and_mul_torch(x: torch.Tensor, out: torch.Tensor | None, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-and-mul: ``x = [gate | up]`` ``[M, 2N]`` -> ``[M, N]``,
    ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)`` in fp32, cast to ``x.dtype``.

    Pure-torch twin of ``sglang.kernels.ops.activation.situ_and_mul`` (JIT CUDA) and of
    ``kimi_core.reference.ops.situ_glu``; used where the CUDA kernel is unavailable.
    """
    n = x.shape[-1] // 2
    g, u = x[..., :n].float(), x[..., n:].float()
    y = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def _situ_kernel():
    try:
        from sglang.kernels.ops.activation import situ_and_mul

        return situ_and_mul
    except Exception:  # noqa: BLE001 - no CUDA toolchain: keep the torch twin
        return situ_and_mul_torch


@contextlib.contextmanager
def _stage2_as_situ(beta: float, linear_beta: float):
    """Bind the stock Marlin LoRA core's activation stage to SiTU for one call.

    The scheduler runs a model forward on one thread, so the module global is never seen by
    another caller; it is restored even when the core raises.
    """
    import sglang.srt.lora.lora_moe_runner_marlin as stock

    kernel = _situ_kernel()
    saved = stock.__dict__.get("silu_and_mul")
    stock.silu_and_mul = lambda inp, out: kernel(inp, out, beta, linear_beta)
    try:
        yield
    finally:
        if saved is None:
            del stock.silu_and_mul
        else:
            stock.silu_and_mul = saved


def _core_base():
    from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore

    return DispatchMoeRunnerCore


class KimiMarlinLoraRunnerCore:
    """Marlin LoRA runner core for SiLU (stock, delegated) and SiTU (K3) gated experts.

    Built per MoE layer by ``MoeRunner`` for ``lora_enabled`` marlin runners. Inputs/outputs are
    the stock ones: ``StandardDispatchOutput`` (hidden ``[M, K]`` bf16, top-k ``[M, k]``) ->
    ``StandardCombineInput`` (``[M, K]``). SiTU's ``beta`` / ``linear_beta`` are the runner
    config's ``gemm1_alpha`` / ``gemm1_clamp_limit`` (as K3's ``FusedMoE`` sets them).
    """

    def __new__(cls, config):
        # subclass DispatchMoeRunnerCore lazily so this module imports without SGLang
        impl = _make_core_class()
        return impl(config)


_CORE_CLASS: list = []


def _make_core_class():
    if _CORE_CLASS:
        return _CORE_CLASS[0]
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.lora.lora_moe_runner_marlin import MarlinLoraRunnerCore

    class _Core(_core_base()):
        __doc__ = KimiMarlinLoraRunnerCore.__doc__

        def __init__(self, config):
            super().__init__(config)
            self._stock = MarlinLoraRunnerCore(config)

        @property
        def runner_backend(self):
            return MoeRunnerBackend.MARLIN

        def run_from_dispatch(self, dispatch_output, quant_info, runner_config, hooks=None):
            if runner_config.activation != "situ":
                return self._stock.run_from_dispatch(dispatch_output, quant_info, runner_config, hooks=hooks)
            if not runner_config.is_gated:
                raise ValueError("kimi_sglang_plugin: SiTU MoE LoRA needs gated experts (w1/w3)")
            beta, lin = runner_config.gemm1_alpha, runner_config.gemm1_clamp_limit
            if beta is None or lin is None:
                raise ValueError("kimi_sglang_plugin: SiTU MoE layer without gemm1_alpha/gemm1_clamp_limit "
                                 "(activation_situ_beta / activation_situ_linear_beta in config.json)")
            as_silu = replace(runner_config, activation="silu")
            with _stage2_as_situ(float(beta), float(lin)):
                return self._stock.run_from_dispatch(dispatch_output, quant_info, as_silu, hooks=hooks)

    _Core.__name__ = _Core.__qualname__ = "KimiMarlinLoraRunnerCore"
    _CORE_CLASS.append(_Core)
    return _Core


def register_runner_core() -> None:
    """Register :class:`KimiMarlinLoraRunnerCore` for the ``marlin`` backend (once per process)."""
    from sglang.srt.layers.moe.moe_runner import runner

    if SITU_RUNNER_BACKEND in runner._CUSTOM_RUNNER_CORE_FACTORIES:
        return
    runner.register_moe_runner_core(SITU_RUNNER_BACKEND, KimiMarlinLoraRunnerCore)


# ------------------------------------------------------------------------------ quant-info adapter
_ADAPTER_CLASS: list = []


def Mxfp4MarlinQuantInfoAdapter(method):  # noqa: N802 - a class factory, named as the class it returns
    """Wrap an ``Mxfp4MoEMethod`` so ``FusedMoEWithLoRA``'s Marlin branch accepts it.

    The returned object is an instance of ``CompressedTensorsFusedMoEMethod`` only to pass the
    stock type gate (its ``__init__`` is never run); ``get_marlin_quant_info(layer)`` returns
    ``build_marlin_moe_quant_info(layer)`` (MXFP4 E8M0 Marlin payload incl. the EP expert map) and
    every other attribute comes from the wrapped method.
    """
    if not _ADAPTER_CLASS:
        from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsFusedMoEMethod,
        )

        class _Adapter(CompressedTensorsFusedMoEMethod):
            def __init__(self, inner):  # noqa: D401 - deliberately skip the parent constructor
                object.__setattr__(self, "_inner", inner)

            def __getattr__(self, name):
                return getattr(object.__getattribute__(self, "_inner"), name)

            def get_marlin_quant_info(self, layer):
                from sglang.srt.layers.quantization.mxfp4_marlin_moe import build_marlin_moe_quant_info

                pad = getattr(self._inner, "hidden_pad", 0) or 0
                if pad:
                    raise ValueError(
                        f"kimi_sglang_plugin: MXFP4 MoE LoRA: expert width {getattr(self._inner, 'hidden_size', '?')} "
                        f"is padded by {pad} for Marlin; the LoRA path does not pad activations. Use a "
                        "routed_expert_hidden_size that is a multiple of the Marlin tile")
                return build_marlin_moe_quant_info(layer)

        _Adapter.__name__ = _Adapter.__qualname__ = "Mxfp4MarlinQuantInfoAdapter"
        _ADAPTER_CLASS.append(_Adapter)
    return _ADAPTER_CLASS[0](method)


def _is_mxfp4(method) -> bool:
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    return isinstance(method, Mxfp4MoEMethod)


def check_int4_marlin(base_layer) -> None:
    """K2.x INT4 experts on the Marlin LoRA path: raise a ``ValueError`` naming the flag when the
    layer cannot be served (not WNA16 4-bit, or not a gated SiLU expert)."""
    method = base_layer.quant_method
    scheme = getattr(method, "scheme", None)
    name = type(scheme).__name__ if scheme is not None else type(method).__name__
    if "WNA16" not in name:
        return  # not the K2.x INT4 path; nothing to check
    bits = getattr(scheme, "num_bits", 4)
    if bits != 4:
        raise ValueError(f"kimi_sglang_plugin: {name} has num_bits={bits}; K2.x experts are INT4 pack-quantized")
    act = base_layer.moe_runner_config.activation
    if act != "silu":
        raise ValueError(f"kimi_sglang_plugin: INT4 MoE LoRA on Marlin needs hidden_act='silu', got {act!r}")


def fused_moe_with_lora_init(original, self, base_layer, lora_backend, *args, **kwargs):
    """AROUND ``FusedMoEWithLoRA.__init__`` (ledger ``moe_lora_mxfp4_quant_info``)."""
    method = base_layer.quant_method
    adapted = method is not None and _is_mxfp4(method)
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
