"""The two 4-bit expert formats of the Kimi releases, keyed by their compressed-tensors format name.

``FORMATS[name]`` is a module with ``pack``, ``unpack``, ``quantize``, ``dequantize`` and
``fake_quant_value``: ``int4`` for ``pack-quantized`` (K2.x) and ``mxfp4`` for
``mxfp4-pack-quantized`` (K3/K3.1).
"""

from kimi_core.quant import int4, mxfp4
from kimi_core.quant.common import FormatError
from kimi_core.quant.fake_quant import fake_int4, fake_mxfp4

FORMATS = {int4.FORMAT: int4, mxfp4.FORMAT: mxfp4}
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


def get_format(name: str):
    """The format module registered under ``name``; raises :class:`FormatError` for unknown names."""
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown quantization format {name!r}; supported: {sorted(FORMATS)}") from None


def dequantize(fmt: str, weight_packed, weight_scale, dtype=None):
    """Exact dequantization of one expert tensor (2-D) or a stack (3-D) in format ``fmt``."""
    import torch

    return get_format(fmt).dequantize(weight_packed, weight_scale, dtype or torch.bfloat16)


__all__ = [
    "FORMATS",
    "FormatError",
    "PACKED_SUFFIXES",
    "dequantize",
    "fake_int4",
    "fake_mxfp4",
    "get_format",
    "int4",
    "mxfp4",
]
