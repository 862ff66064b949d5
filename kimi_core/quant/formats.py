"""The facts of each on-disk expert format, as one object every caller reads.

A :class:`WeightFormat` holds what a loader, kernel or converter needs to know about a compressed-tensors
format without importing its pack / unpack code: the config string, the packed and scale dtypes, how many
4-bit codes one packed element holds and the group size. :meth:`WeightFormat.check` validates a
``(weight_packed, weight_scale)`` pair and names the tensor and file in its error.

Use :func:`weight_format` to go from a config string to the object; compare objects (``fmt is MXFP4``),
never strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_core.quant.common import FormatError

__all__ = ["WeightFormat", "INT4", "MXFP4", "WEIGHT_FORMATS", "weight_format"]


@dataclass(frozen=True)
class WeightFormat:
    """One compressed-tensors expert format.

    :param name: the ``quantization_config.format`` string (``"pack-quantized"``, ``"mxfp4-pack-quantized"``).
    :param packed_dtype: dtype of ``weight_packed`` (int32 for INT4, uint8 for MXFP4).
    :param scale_dtype: dtype of ``weight_scale`` (bf16 for INT4, uint8 E8M0 exponents for MXFP4).
    :param codes_per_packed: 4-bit codes per packed element (8 per int32, 2 per uint8).
    :param group_size: input columns per scale.
    :param short: the short name used on command lines and in benchmark tables (``"int4"``, ``"mxfp4"``).
    """

    name: str
    packed_dtype: torch.dtype
    scale_dtype: torch.dtype
    codes_per_packed: int
    group_size: int
    short: str

    def packed_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """``weight_packed``'s ``[out, in / codes_per_packed]`` for an ``[out, in]`` weight."""
        return out_features, in_features // self.codes_per_packed

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """``weight_scale``'s ``[out, in / group_size]`` for an ``[out, in]`` weight."""
        return out_features, in_features // self.group_size

    def check(self, packed: torch.Tensor, scale: torch.Tensor, *, where: str, in_features: int | None = None) -> int:
        """Validate one packed weight (``[..., out, in/c]``) and its scales; return the input width ``in``.

        :param where: what to name in an error: the tensor and, when known, the file
            (e.g. ``"model-00001.safetensors: model.layers.3.mlp.experts.0.up_proj"``).
        :param in_features: the expected input width, when the caller knows it (from ``weight_shape`` or the config).
        :raises FormatError: wrong dtype, rank, or a packed / scale shape that does not match.
        """
        if packed.dtype != self.packed_dtype:
            raise FormatError(
                f"{where}.weight_packed: dtype {packed.dtype}, format {self.name!r} stores {self.packed_dtype}"
            )
        if scale.dtype != self.scale_dtype:
            raise FormatError(
                f"{where}.weight_scale: dtype {scale.dtype}, format {self.name!r} stores {self.scale_dtype}"
            )
        if packed.dim() < 2:
            raise FormatError(
                f"{where}.weight_packed: shape {tuple(packed.shape)}, expected [out, in/"
                f"{self.codes_per_packed}] or [experts, out, in/{self.codes_per_packed}]"
            )
        k = packed.shape[-1] * self.codes_per_packed
        if in_features is not None and k != in_features:
            raise FormatError(
                f"{where}.weight_packed: shape {tuple(packed.shape)} holds {k} input columns, "
                f"expected {in_features} (last dim {in_features // self.codes_per_packed})"
            )
        want = (*packed.shape[:-1], k // self.group_size)
        if tuple(scale.shape) != want:
            raise FormatError(
                f"{where}: weight_scale shape {tuple(scale.shape)} and weight_packed shape "
                f"{tuple(packed.shape)} disagree; with {k} input columns the scale must be {want}"
            )
        return k


INT4 = WeightFormat("pack-quantized", torch.int32, torch.bfloat16, 8, 32, "int4")
MXFP4 = WeightFormat("mxfp4-pack-quantized", torch.uint8, torch.uint8, 2, 32, "mxfp4")
WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (INT4, MXFP4)}
_BY_SHORT = {f.short: f for f in (INT4, MXFP4)}


def weight_format(name: str | WeightFormat) -> WeightFormat:
    """The format object for a config string or short name (``"pack-quantized"`` or ``"int4"``); objects pass.

    :raises FormatError: an unknown name, with the supported ones listed.
    """
    if isinstance(name, WeightFormat):
        return name
    fmt = WEIGHT_FORMATS.get(name) or _BY_SHORT.get(name)
    if fmt is None:
        raise FormatError(
            f"unknown expert weight format {name!r}; supported: {sorted(WEIGHT_FORMATS)} (or {sorted(_BY_SHORT)})"
        )
    return fmt
