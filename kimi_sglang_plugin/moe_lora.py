"""MoE LoRA on Kimi's 4-bit routed experts in SGLang 0.5.17 and 0.5.23: K3/K3.1 MXFP4 + SiTU, K2.x INT4.

Which mechanism, and why (``docs/sglang.md``, MoE LoRA). With ``--moe-runner-backend marlin``
(the K3 recipe) ``FusedMoEWithLoRA`` builds ``MoeRunner(MARLIN, lora_enabled=True)``, whose
core is ``MarlinLoraRunnerCore``: Marlin gate_up GEMM -> LoRA hook -> ``silu_and_mul`` -> Marlin
down GEMM -> LoRA hook -> sum. Two things stop K3:

1. ``FusedMoEWithLoRA.__init__`` asserts the quant method is a compressed-tensors or ModelOpt
   method and calls ``get_marlin_quant_info``; ``Mxfp4MoEMethod`` has neither (PR #27930 closed),
   although ``mxfp4_marlin_moe.build_marlin_moe_quant_info(layer)`` builds exactly that payload.
2. ``MarlinLoraRunnerCore.run_from_dispatch`` asserts ``activation == "silu"``; K3 experts use SiTU.

A quant-info adapter alone fixes (1) but not (2); a SiTU stage alone never gets the MXFP4
weights. So both, each minimal. This module holds the pieces; the hooks that put them in place are the ledger rows
``moe_lora_marlin.*`` (:mod:`kimi_sglang_plugin.patches.moe_lora_marlin`):

* the constructor hook hands the stock constructor :class:`Mxfp4MarlinQuantInfoAdapter`
  (``build_marlin_moe_quant_info(layer)``); the real quant method is restored right after, so the
  base (non-LoRA) path is untouched.
* the runner hook wraps the stock core's entry. SiLU layers (K2.x INT4) pass
  through. A SiTU layer runs the same stock core with its activation stage bound to SiTU for that
  call: the Marlin GEMMs, expert alignment, EP masking and LoRA hooks stay upstream's,
  single-sourced; only stage 2 differs. 0.5.23 also offers ``register_moe_runner_core``, but
  0.5.17 builds ``MarlinLoraRunnerCore`` directly (``moe_runner/runner.py:77``), so the hook on
  the core's entry is the narrowest point that exists in both releases.

The same constructor hook fixes a further K3 bug: ``FusedMoEWithLoRA`` infers GPT-OSS interleaved
gate/up from ``gemm1_alpha``, which K3 sets for SiTU's beta although its w13 is not interleaved
(``gate_up_interleaved=False``); the LoRA gate_up ``B`` would be row-shuffled. On 0.5.17 only,
:class:`MarlinShapeView` lets the CUDA-graph buffer setup read the Marlin quant info.

K2.x INT4 (``pack-quantized``, scheme ``CompressedTensorsWNA16MoE``) already exposes
``get_marlin_quant_info``; :func:`check_int4_marlin` only validates the pairing and names the
flag to change. Everything here that launches kernels needs a GPU (SM90+ for MXFP4 Marlin).
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

import torch

from kimi_core.errors import PluginError
from kimi_core.quant.formats import INT4
from kimi_core.reference.ops import situ_glu

__all__ = [
    "SITU_KERNELS",
    "MarlinShapeView",
    "Mxfp4MarlinQuantInfoAdapter",
    "check_int4_marlin",
    "is_mxfp4_method",
    "situ_activation_stage",
    "situ_and_mul_torch",
    "situ_kernel",
]

#: SGLang release -> ``"module:function"`` of its fused SiTU-and-mul kernel (``host_support.FACTS`` rows)
SITU_KERNELS = {
    "0.5.17": "sglang.kernels.ops.kimi_k3:situ_and_mul",
    "0.5.23": "sglang.kernels.ops.activation:situ_and_mul",
}


def situ_and_mul_torch(x: torch.Tensor, out: torch.Tensor | None, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-and-mul: ``x = [gate | up]`` ``[M, 2N]`` -> ``[M, N]``,
    ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)`` in fp32, cast to ``x.dtype``.

    SGLang's kernel signature (:data:`SITU_KERNELS`) over ``kimi_core.reference.ops.situ_glu`` (the one
    formula); used where no CUDA device is present.
    """
    n = x.shape[-1] // 2
    y = situ_glu(x[..., :n].float(), x[..., n:].float(), beta, linear_beta)  # fp32 inside, as the kernel
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def situ_kernel():
    """The running release's SiTU kernel; the torch twin only where CUDA is absent (CPU tests)."""
    from kimi_sglang_plugin.registration import running_sglang

    if not torch.cuda.is_available():
        return situ_and_mul_torch
    release = running_sglang()
    target = SITU_KERNELS.get(release)
    if target is None:
        raise PluginError(
            f"kimi_sglang_plugin: no SiTU kernel recorded for SGLang {release!r} (known: {sorted(SITU_KERNELS)})"
        )
    mod, name = target.split(":")
    return getattr(importlib.import_module(mod), name)


@contextlib.contextmanager
def situ_activation_stage(beta: float, linear_beta: float):
    """Bind the stock Marlin LoRA core's activation stage to SiTU for one call.

    The core calls its module-level ``silu_and_mul`` (lora/lora_moe_runner_marlin.py:160 in 0.5.17,
    the same name in 0.5.23). The scheduler runs a model forward on one thread, so the module global
    is never seen by another caller; it is restored even when the core raises.
    """
    import sglang.srt.lora.lora_moe_runner_marlin as stock

    kernel = situ_kernel()
    saved = stock.__dict__.get("silu_and_mul")
    stock.silu_and_mul = lambda inp, out: kernel(inp, out, beta, linear_beta)
    try:
        yield
    finally:
        if saved is None:
            del stock.silu_and_mul
        else:
            stock.silu_and_mul = saved


# ------------------------------------------------------------------------------ quant-info adapter
_ADAPTER_CLASS: list = []


def Mxfp4MarlinQuantInfoAdapter(method):
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
            def __init__(self, inner):
                object.__setattr__(self, "_inner", inner)

            def __getattr__(self, name):
                return getattr(object.__getattribute__(self, "_inner"), name)

            def get_marlin_quant_info(self, layer):
                from sglang.srt.layers.quantization.mxfp4_marlin_moe import build_marlin_moe_quant_info

                for attr, what, fix in _MARLIN_PADS:
                    pad = getattr(self._inner, attr, 0) or 0
                    if pad:
                        raise ValueError(
                            f"kimi_sglang_plugin: MXFP4 MoE LoRA: the experts' {what} is padded by {pad} "
                            f"for Marlin and the LoRA path is not; {fix}"
                        )
                return build_marlin_moe_quant_info(layer)

        _Adapter.__name__ = _Adapter.__qualname__ = "Mxfp4MarlinQuantInfoAdapter"
        _ADAPTER_CLASS.append(_Adapter)
    return _ADAPTER_CLASS[0](method)


#: (Mxfp4MoEMethod attribute, what it pads, the fix). create_weights pads both for Marlin (0.5.17
#: layers/quantization/mxfp4.py:395-403); LoRA buffers and activations keep the checkpoint's widths
_MARLIN_PADS = (
    ("hidden_pad", "hidden width", "use a routed_expert_hidden_size that is a multiple of 256"),
    (
        "intermediate_pad",
        "per-rank intermediate width",
        "make moe_intermediate_size / moe-TP a multiple of 128 (--ep-size, or a smaller --tp-size)",
    ),
)


def is_mxfp4_method(method) -> bool:
    """Whether ``method`` is SGLang's ``Mxfp4MoEMethod`` (K3 / K3.1 experts)."""
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
        raise ValueError(f"kimi_sglang_plugin: {name} has num_bits={bits}; K2.x experts are 4-bit {INT4.name!r}")
    act = base_layer.moe_runner_config.activation
    if act != "silu":
        raise ValueError(f"kimi_sglang_plugin: INT4 MoE LoRA on Marlin needs hidden_act='silu', got {act!r}")


class _ShapeOnly:
    """Stands in for a weight whose ``shape`` and ``device`` are all that is read."""

    def __init__(self, shape, device):
        self.shape, self.device = torch.Size(shape), device


class MarlinShapeView:
    """A ``FusedMoEWithLoRA`` seen through an unquantized-style quant info (``w13_weight`` ``[E, 2I, K]``,
    ``w2_weight`` ``[E, K, I]``, shape and device only); every other attribute is the layer's own. SGLang 0.5.17
    sizes the MoE LoRA CUDA-graph buffers from those shapes, which a Marlin quant info does not have."""

    def __init__(self, layer):
        base, qinfo = layer.base_layer, layer._quant_info
        E, I, K = base.num_local_experts, base.intermediate_size_per_partition, base.hidden_size
        dev = qinfo.w13_qweight.device
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(
            self,
            "_quant_info",
            SimpleNamespace(w13_weight=_ShapeOnly((E, 2 * I, K), dev), w2_weight=_ShapeOnly((E, K, I), dev)),
        )

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_layer"), name)
