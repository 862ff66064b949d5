"""The format objects of kimi_core.quant.formats against what compressed-tensors itself writes (the oracle)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from kimi_core.quant import FormatError
from kimi_core.quant.formats import INT4, MXFP4, WEIGHT_FORMATS, weight_format

SHAPES = [(8, 32), (33, 64), (7, 320)]


def _weights(shape):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def test_names_are_compressed_tensors_format_strings():
    """Each format's name is the compressed-tensors CompressionFormat value of that layout."""
    assert INT4.name == CompressionFormat.pack_quantized.value
    assert MXFP4.name == CompressionFormat.mxfp4_pack_quantized.value
    assert set(WEIGHT_FORMATS) == {INT4.name, MXFP4.name}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_int4_facts_match_the_compressor(shape):
    """dtypes and shapes of INT4 equal PackedQuantizationCompressor's output, and check() accepts it."""
    w = _weights(shape)
    scale = (w.reshape(shape[0], -1, 32).abs().amax(-1).float() / 7.5).to(torch.bfloat16)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    )
    ref = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    packed = ref["weight_packed"]
    assert packed.dtype == INT4.packed_dtype and scale.dtype == INT4.scale_dtype
    assert tuple(packed.shape) == INT4.packed_shape(*shape)
    assert tuple(scale.shape) == INT4.scale_shape(*shape)
    assert INT4.check(packed, scale, where="w", in_features=shape[1]) == shape[1]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_mxfp4_facts_match_the_compressor(shape):
    """dtypes and shapes of MXFP4 equal MXFP4PackedCompressor's output, and check() accepts it."""
    w = _weights(shape)
    g = w.reshape(shape[0], -1, 32)
    args = QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8
    )
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
    ref = MXFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale}, QuantizationScheme(targets=["Linear"], weights=args)
    )
    packed, scale = ref["weight_packed"], ref["weight_scale"]
    assert packed.dtype == MXFP4.packed_dtype and scale.dtype == MXFP4.scale_dtype
    assert tuple(packed.shape) == MXFP4.packed_shape(*shape)
    assert tuple(scale.shape) == MXFP4.scale_shape(*shape)
    assert MXFP4.check(packed, scale, where="w", in_features=shape[1]) == shape[1]


@pytest.mark.parametrize(
    "fmt,packed,scale,in_features,message",
    [
        pytest.param(
            INT4,
            torch.zeros(4, 8, dtype=torch.uint8),
            torch.zeros(4, 2, dtype=torch.bfloat16),
            None,
            "x.weight_packed: dtype torch.uint8",
            id="int4-wrong-packed-dtype",
        ),
        pytest.param(
            INT4,
            torch.zeros(4, 8, dtype=torch.int32),
            torch.zeros(4, 2, dtype=torch.uint8),
            None,
            "x.weight_scale: dtype torch.uint8",
            id="int4-wrong-scale-dtype",
        ),
        pytest.param(
            INT4,
            torch.zeros(4, 8, dtype=torch.int32),
            torch.zeros(4, 3, dtype=torch.bfloat16),
            None,
            "must be (4, 2)",
            id="int4-scale-shape",
        ),
        pytest.param(
            INT4,
            torch.zeros(4, 8, dtype=torch.int32),
            torch.zeros(4, 2, dtype=torch.bfloat16),
            128,
            "holds 64 input columns, expected 128",
            id="int4-packed-width",
        ),
        pytest.param(
            MXFP4,
            torch.zeros(8, dtype=torch.uint8),
            torch.zeros(1, dtype=torch.uint8),
            None,
            "x.weight_packed: shape (8,)",
            id="mxfp4-rank",
        ),
        pytest.param(
            MXFP4,
            torch.zeros(2, 4, 32, dtype=torch.uint8),
            torch.zeros(2, 4, 1, dtype=torch.uint8),
            None,
            "must be (2, 4, 2)",
            id="mxfp4-stacked-scale-shape",
        ),
    ],
)
def test_check_names_the_tensor(fmt, packed, scale, in_features, message):
    """A wrong dtype, rank or shape is a FormatError naming the tensor and the expected value."""
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fmt.check(packed, scale, where="x", in_features=in_features)


def test_weight_format_lookup():
    """Config strings and short names find the object; an unknown one lists the supported names."""
    assert weight_format("pack-quantized") is INT4 and weight_format("int4") is INT4
    assert weight_format("mxfp4") is MXFP4 and weight_format(MXFP4) is MXFP4
    with pytest.raises(FormatError, match="nvfp4.*supported"):
        weight_format("nvfp4")
