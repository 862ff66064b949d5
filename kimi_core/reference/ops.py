"""Pure-torch elementwise / normalisation maths shared by every reference module.

Every function is written from the formulas in ``docs/models.md``; none is ported
from an upstream file. Functions keep the input dtype at their boundary and compute "fp32
islands" (norm statistics, SiTU, gates) in ``acc_dtype(x.dtype)``, i.e. fp32, or fp64 when the
whole model runs in fp64 for a float64 recomputation.

The single linear helper :func:`linear` is the only place a weight multiplies an activation, so
a LoRA delta is added uniformly to every projection of every model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = [
    "LoraLike",
    "acc_dtype",
    "linear",
    "lora_delta",
    "rms_norm",
    "layer_norm",
    "l2norm",
    "silu_glu",
    "situ_glu",
    "glu",
    "L2NORM_EPS",
]

# fla's l2norm: x * rsqrt(sum(x^2) + 1e-6) [I] (kimi_arch.md 1.2; transformers' KimiLinear uses the same value).
L2NORM_EPS = 1e-6


class LoraLike(Protocol):
    """One LoRA pair as ``kimi_core.lora.LoraFactors`` defines it: ``A [r, in]``, ``B [out, r]`` (fp32)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the fp32 islands: fp32, or fp64 when the model itself is fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lora_delta(x: torch.Tensor, lora: LoraLike) -> torch.Tensor:
    """``scaling * (x @ A.T) @ B.T``; ``x [..., in]`` -> ``[..., out]`` in ``acc_dtype(x.dtype)``.

    In an fp32 / fp64 model the factors and the rank-``r`` intermediate stay in that precision. In a
    bf16 / fp16 model the factors are parameters of the model like its weights, so they are rounded to
    its dtype, and so is the intermediate ``x @ A.T`` (what a bf16 engine's LoRA kernels store between
    their shrink and expand GEMMs); both products accumulate in fp32 and the scaling is applied in fp32.
    """
    a = acc_dtype(x.dtype)
    if x.dtype in (torch.float32, torch.float64):
        return lora.scaling * F.linear(F.linear(x, lora.A.to(x.device, a)), lora.B.to(x.device, a))
    shrunk = F.linear(x, lora.A.to(x.device, x.dtype))  # bf16 out, as the shrink kernel stores it
    return lora.scaling * F.linear(shrunk.to(a), lora.B.to(x.device, x.dtype).to(a))


def linear(x: torch.Tensor, weight: torch.Tensor, lora: LoraLike | None = None) -> torch.Tensor:
    """``x @ weight.T`` (+ the LoRA delta when ``lora`` is given). ``x [..., in]``, ``weight [out, in]``.

    The product runs in ``weight.dtype``; the delta (:func:`lora_delta`) is added in fp32 (fp64 for an
    fp64 model) before the cast back, which in an fp32 model is what merging ``W + s B A`` gives.
    """
    y = F.linear(x.to(weight.dtype), weight)
    if lora is not None:
        y = (y.to(acc_dtype(y.dtype)) + lora_delta(x.to(weight.dtype), lora)).to(weight.dtype)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, statistics in fp32; ``x [..., D]``."""
    a = acc_dtype(x.dtype)
    xf = x.to(a)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(a)
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Standard LayerNorm over the last dim in fp32; ``x [..., D]``, ``weight``/``bias [D]``."""
    a = acc_dtype(x.dtype)
    y = F.layer_norm(x.to(a), (x.shape[-1],), weight.to(a), None if bias is None else bias.to(a), eps)
    return y.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (fla's ``l2norm``, [I] for the eps); fp32 out."""
    xf = x.to(acc_dtype(x.dtype))
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the input dtype (K2.x MLPs, ``hidden_act="silu"``)."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of K3: ``[beta*tanh(a/beta) * sigmoid(a)] * [beta_lin*tanh(b/beta_lin)]``, computed in fp32.

    The sigmoid takes the uncapped ``a`` (kimi_arch.md section 3, radixark/miles ``situ_and_mul``).
    ``gate``, ``up``: ``[..., I]``; returns ``[..., I]`` in the input dtype.
    """
    a_dt = acc_dtype(gate.dtype)
    a, b = gate.to(a_dt), up.to(a_dt)
    y = (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (beta_lin * torch.tanh(b / beta_lin))
    return y.to(gate.dtype)


def glu(config: KimiConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation named by ``config.hidden_act`` (``silu`` or ``situ``).

    K3 applies SiTU to the dense layer-0 MLP and the shared experts as well as the routed experts;
    that holds for Megatron [S] and is inferred for HF inference [I] (kimi_arch.md section 3).
    """
    act = config.hidden_act
    if act == "situ":
        return situ_glu(gate, up, config.activation_situ_beta, config.activation_situ_linear_beta)
    if act == "silu":
        return silu_glu(gate, up)
    raise ValueError(f"config.json: hidden_act={act!r}; the reference supports 'silu' (K2.x) and 'situ' (K3)")
