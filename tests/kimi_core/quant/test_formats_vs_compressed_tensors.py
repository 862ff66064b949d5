"""Bit-exactness of kimi_core.quant against compressed-tensors' own compressors (the library is the oracle)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from kimi_core.quant import FormatError, int4, mxfp4

SHAPES = [(8, 32), (33, 64), (128, 96), (7, 320), (64, 1024)]
SEEDS = [0, 1, 2]


def _int4_scheme():
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    )


def _mx_args():
    return QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8
    )


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    w[0, :32] = 0.0  # an all-zero group
    return w.to(torch.bfloat16)


def _ct_int4_scale(w, divisor):
    g = w.reshape(w.shape[0], -1, 32)
    return (g.abs().amax(-1).float() / divisor).to(torch.bfloat16)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_int4_pack_matches_compressor(shape, seed):
    """Our INT4 packing of RTN codes equals PackedQuantizationCompressor.compress byte for byte."""
    w = _weights(shape, seed)
    ours = int4.quantize(w, 7.5, -8)
    ref = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": ours["weight_scale"]}, _int4_scheme())
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])
    assert torch.equal(ours["weight_shape"], ref["weight_shape"].to(torch.int64))
    # the scale itself: compressed-tensors' symmetric qparams are amax / 7.5 (bit range 15 / 2)
    nz = ours["weight_scale"] != 0
    assert torch.equal(ours["weight_scale"][nz], _ct_int4_scale(w, 7.5)[nz])


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
@pytest.mark.parametrize("convention", ["kimi", "rtn"])
def test_int4_dequantize_matches_decompress(shape, seed, convention):
    """Our INT4 dequantization equals PackedQuantizationCompressor.decompress exactly, both conventions."""
    w = _weights(shape, seed)
    t = int4.quantize(w, *int4.CONVENTIONS[convention])
    ref = PackedQuantizationCompressor.decompress(dict(t), _int4_scheme())["weight"]
    got = int4.dequantize(t["weight_packed"], t["weight_scale"], ref.dtype)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_mxfp4_quantize_matches_compressor(shape, seed):
    """Our MXFP4 scales equal compressed-tensors' MX qparams and our bytes equal MXFP4PackedCompressor.compress."""
    w = _weights(shape, seed)
    ours = mxfp4.quantize(w)
    g = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), _mx_args())
    nz = g.abs().amax(-1) != 0
    ours_scale = mxfp4.scale_values(ours["weight_scale"]).to(scale.dtype)
    assert torch.equal(ours_scale[nz], scale[nz])
    scheme = QuantizationScheme(targets=["Linear"], weights=_mx_args())
    ref = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(
        ours["weight_packed"][nz.repeat_interleave(16, -1)], ref["weight_packed"][nz.repeat_interleave(16, -1)]
    )
    assert torch.equal(ours["weight_scale"][nz], ref["weight_scale"][nz])


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_mxfp4_dequantize_matches_decompress(shape, seed):
    """Our MXFP4 dequantization equals MXFP4PackedCompressor.decompress exactly (bf16)."""
    w = _weights(shape, seed)
    t = mxfp4.quantize(w)
    scheme = QuantizationScheme(targets=["Linear"], weights=_mx_args())
    ref = MXFP4PackedCompressor.decompress(dict(t), scheme)["weight"]
    got = mxfp4.dequantize(t["weight_packed"], t["weight_scale"], torch.bfloat16)
    assert torch.equal(got, ref)


def test_mxfp4_all_codes_and_ties():
    """Every E2M1 boundary value rounds to the even code as compressed-tensors' cast does."""
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    x = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 0.3, 4.9, 5.1])
    x = torch.cat([x, -x])
    ref = FP4_E2M1_DATA.cast_to_fp4(x.clone())
    got = mxfp4.e2m1_table()[mxfp4.encode_e2m1(x).long()]
    assert torch.equal(got.abs(), ref.abs())


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_3d_stacks_match_per_expert(fmt):
    """A stacked [E, N, K] tensor packs and dequantizes exactly like its experts one at a time."""
    w = torch.stack([_weights((16, 64), s) for s in range(5)])
    mod = int4 if fmt == "int4" else mxfp4
    t = mod.quantize(w)
    for e in range(5):
        te = mod.quantize(w[e])
        assert torch.equal(t["weight_packed"][e], te["weight_packed"])
        assert torch.equal(t["weight_scale"][e], te["weight_scale"])
        assert torch.equal(
            mod.dequantize(t["weight_packed"], t["weight_scale"])[e],
            mod.dequantize(te["weight_packed"], te["weight_scale"]),
        )


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_input_dim_not_multiple_of_32_is_rejected(fmt):
    """Quantizing a [N, K] weight with K % 32 != 0 raises FormatError naming the input dim."""
    mod = int4 if fmt == "int4" else mxfp4
    with pytest.raises(FormatError, match="input dim 48"):
        mod.quantize(torch.randn(8, 48))
