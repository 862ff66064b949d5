"""The public W4A16 grouped GEMM ops: forward, dgrad and the autograd function tying them.

Each op checks its operands once (:func:`.operands.check_operands`), asks :func:`.dispatch.choose_path` which
backend runs it and calls that backend with arguments already validated. Triton is imported only on first GPU use,
so these ops import (and run, through :mod:`.naive` or :mod:`.chunked`) on machines without a GPU or Triton.

Example::

    from kimi_core.kernels import w4a16_grouped_linear
    from kimi_core.quant.formats import MXFP4
    y = w4a16_grouped_linear(x, layer.weight_packed, layer.weight_scale, MXFP4.name, [5, 0, 11])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kimi_core.kernels.host_ints import split_pattern
from kimi_core.kernels.w4a16 import chunked, naive
from kimi_core.kernels.w4a16.dispatch import FUSED_OPTIONS, GLUON_OPTIONS, choose_path
from kimi_core.kernels.w4a16.operands import check_operands
from kimi_core.quant.formats import WeightFormat

__all__ = ["W4A16GroupedGemm", "run_gluon", "w4a16_grouped_gemm", "w4a16_grouped_gemm_dgrad", "w4a16_grouped_linear"]


def run_gluon(
    op: str,
    a: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt: str | WeightFormat,
    m_splits: Sequence[int] | torch.Tensor,
    options: dict | None = None,
) -> torch.Tensor:
    """One op (``"fwd"``: ``a`` = ``x`` ``[T, K]``; ``"dgrad"``: ``a`` = ``dy`` ``[T, N]``) on the Gluon register
    kernels with ``options`` as their keyword arguments (default :data:`.dispatch.GLUON_OPTIONS`, what the
    ``"gluon"`` path runs)."""
    from kimi_core.kernels.w4a16 import gluon

    options = dict(GLUON_OPTIONS[op] if options is None else options)
    fn = gluon.grouped_gemm if op == "fwd" else gluon.grouped_gemm_dgrad
    return fn(a, w_packed, w_scale, fmt, m_splits, **options)


def w4a16_grouped_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt: str | WeightFormat,
    m_splits: Sequence[int] | torch.Tensor,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """Grouped ``y = x . dequant(W_e)^T`` over experts, weights kept 4-bit.

    :param x: ``[T, K]`` bf16, rows sorted by expert.
    :param w_packed: MXFP4 uint8 ``[E, N, K/2]`` or INT4 int32 ``[E, N, K/8]`` (on-disk layouts of
        :mod:`kimi_core.quant.mxfp4` / :mod:`kimi_core.quant.int4`).
    :param w_scale: MXFP4 E8M0 uint8 ``[E, N, K/32]`` or INT4 bf16 ``[E, N, K/32]``.
    :param fmt: :data:`kimi_core.quant.formats.MXFP4` / ``INT4`` or its config string.
    :param m_splits: rows per expert, ``list[int]``, CPU or device integer tensor ``[E]``; zeros allowed. Host splits
        are read once per call and their tables cached per split pattern; device splits are never read back.
    :param path: ``"fused"``, ``"chunked"``, ``"gluon"`` or ``"auto"`` (default: ``$KIMI_W4A16_PATH``, else auto),
        see :func:`.dispatch.choose_path`.
    :returns: ``[T, N]`` bf16 (fp32 accumulation). Naive twin: :func:`.naive.w4a16_grouped_gemm`.
    """
    E, N, K, m_splits = check_operands(x, "x", w_packed, w_scale, fmt, m_splits, "K")
    chosen = choose_path("fwd", x.shape[0], E, N, K, x.device, path)
    if chosen == "chunked":
        return chunked.grouped_gemm(x, w_packed, w_scale, fmt, m_splits)
    if chosen == "gluon":
        return run_gluon("fwd", x, w_packed, w_scale, fmt, m_splits)
    if x.is_cuda:
        from kimi_core.kernels.w4a16 import fused

        return fused.grouped_gemm(x, w_packed, w_scale, fmt, m_splits, **FUSED_OPTIONS["fwd"])
    return naive.w4a16_grouped_gemm(x, w_packed, w_scale, fmt, m_splits)


def w4a16_grouped_gemm_dgrad(
    dy: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt: str | WeightFormat,
    m_splits: Sequence[int] | torch.Tensor,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """Grouped ``dx = dy . dequant(W_e)``: the activation gradient of :func:`w4a16_grouped_gemm`.

    :param dy: ``[T, N]`` bf16, rows sorted by expert; other arguments as in the forward.
    :returns: ``[T, K]`` bf16 (fp32 accumulation). Naive twin: :func:`.naive.w4a16_grouped_gemm_dgrad`.
    """
    E, N, K, m_splits = check_operands(dy, "dy", w_packed, w_scale, fmt, m_splits, "N")
    chosen = choose_path("dgrad", dy.shape[0], E, N, K, dy.device, path)
    if chosen == "chunked":
        return chunked.grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits)
    if chosen == "gluon":
        return run_gluon("dgrad", dy, w_packed, w_scale, fmt, m_splits)
    if dy.is_cuda:
        from kimi_core.kernels.w4a16 import fused

        return fused.grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits, **FUSED_OPTIONS["dgrad"])
    return naive.w4a16_grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits)


class W4A16GroupedGemm(torch.autograd.Function):
    """Autograd of the grouped W4A16 GEMM: forward :func:`w4a16_grouped_gemm`, backward its dgrad.

    The 4-bit weights are frozen, so ``backward`` returns a gradient for ``x`` only. Forward (and so an
    activation recompute) and dgrad each ask :func:`.dispatch.choose_path`, with the same ``path`` override.
    """

    @staticmethod
    def forward(ctx, x, w_packed, w_scale, fmt, m_splits, *path):
        ctx.save_for_backward(w_packed, w_scale)
        ctx.n_inputs = 5 + len(path)  # ``path`` is optional: apply(x, w_packed, w_scale, fmt, m_splits[, path])
        # host splits read once for the forward and the dgrad (their tables cached per pattern)
        pattern = split_pattern(m_splits)
        m_splits = pattern if pattern is not None else m_splits
        ctx.fmt, ctx.m_splits, ctx.path = fmt, m_splits, path[0] if path else None
        return w4a16_grouped_gemm(x, w_packed, w_scale, fmt, m_splits, path=ctx.path)

    @staticmethod
    def backward(ctx, dy):
        w_packed, w_scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = w4a16_grouped_gemm_dgrad(
                dy.to(torch.bfloat16).contiguous(), w_packed, w_scale, ctx.fmt, ctx.m_splits, path=ctx.path
            )
        return (dx,) + (None,) * (ctx.n_inputs - 1)


def w4a16_grouped_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt: str | WeightFormat,
    m_splits: Sequence[int] | torch.Tensor,
    path: str | None = None,
) -> torch.Tensor:
    """Differentiable :func:`w4a16_grouped_gemm` (``x`` ``[T, K]`` bf16 -> ``[T, N]`` bf16); gradients reach ``x``
    only. ``path`` forces ``"fused"`` / ``"chunked"`` / ``"gluon"`` for the forward and the dgrad (default:
    :func:`.dispatch.choose_path`)."""
    return W4A16GroupedGemm.apply(x, w_packed, w_scale, fmt, m_splits, path)
