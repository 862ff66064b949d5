"""Shared helpers of the 4-bit formats: group reshapes and shape checks with clear errors."""

from __future__ import annotations

import torch

from kimi_core.errors import KimiError


class FormatError(KimiError, ValueError):
    """A tensor does not match the on-disk layout of its declared format."""


def group_view(x: torch.Tensor, group: int, what: str = "tensor") -> torch.Tensor:
    """``[..., K]`` -> ``[..., K/group, group]``; raises :class:`FormatError` if ``group`` does not divide ``K``."""
    if x.dim() < 2:
        raise FormatError(
            f"{what}: expected a 2-D [out, in] or 3-D [experts, out, in] tensor, got shape {tuple(x.shape)}"
        )
    k = x.shape[-1]
    if k % group:
        raise FormatError(f"{what}: input dim {k} is not a multiple of the group size {group} (shape {tuple(x.shape)})")
    return x.reshape(*x.shape[:-1], k // group, group)


def ungroup(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(-2)


def check_grouped(what: str, codes: torch.Tensor, scale: torch.Tensor, group: int) -> None:
    want = (*codes.shape[:-1], codes.shape[-1] // group)
    if tuple(scale.shape) != want:
        raise FormatError(
            f"{what}: shape {tuple(scale.shape)} does not match weight codes {tuple(codes.shape)}; expected {want}"
        )
