"""Checks of a W4A16 grouped GEMM's operands, run once at the public boundary (:mod:`.grouped_gemm`) and by the
Gluon launcher that can be called on its own."""

from __future__ import annotations

import torch

from kimi_core.kernels.host_ints import SplitPattern, split_pattern
from kimi_core.quant.formats import INT4, MXFP4, WEIGHT_FORMATS, WeightFormat

__all__ = ["WHERE", "check_operands", "operand_format"]

WHERE = "kimi_core/kernels/w4a16"


def _check_tensor(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{WHERE}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{WHERE}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{WHERE}: {name} must be {dtype}, got {t.dtype}")


def operand_format(fmt: str | WeightFormat) -> WeightFormat:
    """The :class:`~kimi_core.quant.formats.WeightFormat` of ``fmt`` (a format object or its config string)."""
    found = fmt if isinstance(fmt, WeightFormat) else WEIGHT_FORMATS.get(fmt)
    if found is None:
        raise ValueError(f"{WHERE}: fmt must be {MXFP4.name!r} or {INT4.name!r}, got {fmt!r}")
    return found


def check_operands(
    a: torch.Tensor, a_name: str, w_packed, w_scale, fmt, m_splits, a_cols: str
) -> tuple[int, int, int, SplitPattern | torch.Tensor]:
    """Check shapes, dtypes and devices of one call; returns ``(E, N, K, splits)``, ``splits`` the
    :class:`~kimi_core.kernels.host_ints.SplitPattern` of host splits (read once here, its tables cached per
    pattern) or the device tensor as given (never read back).

    :param a: the activation, ``x`` ``[T, K]`` (``a_cols="K"``) or ``dy`` ``[T, N]`` (``a_cols="N"``), bf16.
    :param w_packed: ``fmt.packed_dtype`` ``[E, N, K / fmt.codes_per_packed]``.
    :param w_scale: ``fmt.scale_dtype`` ``[E, N, K / 32]``.
    :param m_splits: ``E`` row counts (list, CPU or device integer tensor); host splits must sum to ``T``.
    """
    wf = operand_format(fmt)
    _check_tensor("w_packed", w_packed, 3, wf.packed_dtype)
    _check_tensor("w_scale", w_scale, 3, wf.scale_dtype)
    E, N = w_packed.shape[0], w_packed.shape[1]
    K = w_packed.shape[2] * wf.codes_per_packed
    if tuple(w_scale.shape) != (E, N, K // wf.group_size) or K % wf.group_size:
        raise ValueError(
            f"{WHERE}: w_scale shape {tuple(w_scale.shape)} does not match w_packed "
            f"{tuple(w_packed.shape)} ({wf.name}); expected {(E, N, K // wf.group_size)}"
        )
    _check_tensor(a_name, a, 2, torch.bfloat16)
    want = K if a_cols == "K" else N
    if a.shape[1] != want:
        raise ValueError(f"{WHERE}: {a_name} has {a.shape[1]} columns, expected {a_cols} = {want}")
    pattern = split_pattern(m_splits)
    n_splits = len(pattern) if pattern is not None else m_splits.numel()
    if n_splits != E:
        raise ValueError(f"{WHERE}: m_splits has {n_splits} entries, expected one per expert ({E})")
    if pattern is not None and pattern.total != a.shape[0]:
        raise ValueError(f"{WHERE}: m_splits sum to {pattern.total}, but {a_name} has {a.shape[0]} rows")
    if a.device != w_packed.device or a.device != w_scale.device:
        raise ValueError(
            f"{WHERE}: {a_name}, w_packed and w_scale must share a device, got "
            f"{a.device}, {w_packed.device}, {w_scale.device}"
        )
    return E, N, K, pattern if pattern is not None else m_splits
