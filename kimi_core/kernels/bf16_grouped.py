"""BF16 grouped linear over unquantized experts: ``y[rows_e] = x[rows_e] . W_e^T`` for rows sorted by expert.

The BF16 baseline of the W4A16 kernels (the same experts held as bf16 ``[E, N, K]``): one ``torch._grouped_mm``
(CUTLASS grouped GEMM on sm90, fp32 accumulation; torch's own kernel on the CPU) with autograd to ``x`` and ``w``,
where it applies, else one ``F.linear`` per expert. ``_grouped_mm`` applies to bf16 operands on a CUDA device of
compute capability 9.0+ or on the CPU, with ``K`` and ``N`` multiples of 8 (16-byte rows for both operands).

Shapes and dtypes: ``x`` ``[T, K]``, ``w`` ``[E, N, K]``, ``m_splits`` ``E`` row counts (list or tensor, summing to
``T``); result ``[T, N]`` in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_core.kernels.device import device_capability
from kimi_core.kernels.host_ints import host_offsets, int32_on

__all__ = ["bf16_grouped_linear", "uses_grouped_mm"]


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`bf16_grouped_linear` runs ``torch._grouped_mm`` for these operands (else a per-expert loop)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if w.shape[-1] % 8 or w.shape[-2] % 8:
        return False
    if x.device.type == "cuda":
        return device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


def bf16_grouped_linear(x: torch.Tensor, w: torch.Tensor, m_splits) -> torch.Tensor:
    """``[T, N]``: each expert's rows of ``x`` ``[T, K]`` times its ``w[e]`` ``[N, K]`` transposed (see the module
    docstring)."""
    splits = [int(v) for v in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
    if (
        w.dim() != 3
        or x.dim() != 2
        or len(splits) != w.shape[0]
        or x.shape[1] != w.shape[2]
        or sum(splits) != x.shape[0]
    ):
        raise ValueError(
            f"kimi_core.kernels.bf16_grouped_linear: x {tuple(x.shape)}, w {tuple(w.shape)} and "
            f"m_splits ({len(splits)} experts, {sum(splits)} rows) do not match ([T, K], [E, N, K], E "
            "counts summing to T)"
        )
    if x.shape[0] == 0:  # no rows: an empty product that still reaches w in the graph (zero gradient), no reduction
        return F.linear(x, w[0]) if w.shape[0] else x.new_zeros(0, w.shape[1])
    if uses_grouped_mm(x, w):
        offs = int32_on(host_offsets(splits)[1:], x.device)  # each expert's end row
        return torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offs, out_dtype=x.dtype)
    outs = [F.linear(xe, w[e]) for e, xe in enumerate(x.split(splits))]
    return torch.cat(outs)
