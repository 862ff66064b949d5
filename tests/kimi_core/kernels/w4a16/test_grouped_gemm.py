"""The public W4A16 grouped GEMM ops (:mod:`kimi_core.kernels.w4a16.grouped_gemm`) on the CPU, where they run the
naive twin, against a float32 oracle; and their operand checks."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_close

from kimi_core.kernels import (
    INT4_FORMAT,
    MXFP4_FORMAT,
    w4a16_grouped_gemm,
    w4a16_grouped_gemm_dgrad,
    w4a16_grouped_linear,
)

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, oracle_dgrad, oracle_fwd, random_packed

CPU_CASES = [
    pytest.param(3, 64, 96, [5, 0, 11], id="E3-N64-K96-ragged-empty"),
    pytest.param(4, 48, 256, [0, 0, 7, 1], id="E4-N48-K256-leading-empty"),
    pytest.param(2, 32, 64, [0, 0], id="E2-all-empty"),
    pytest.param(5, 80, 160, [17, 3, 0, 33, 9], id="E5-N80-K160"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,N,K,splits", CPU_CASES)
def test_fallback_forward_matches_oracle(fmt, E, N, K, splits):
    """The CPU fallback forward equals the fp32 matmul of the dequantized experts, row block by row block."""
    wp, ws = random_packed(fmt, E, N, K, seed=E + K)
    x = torch.randn(sum(splits), K).bfloat16()
    y = w4a16_grouped_gemm(x, wp, ws, fmt, splits)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(splits), N)
    if y.numel():
        assert_close(f"fwd {fmt}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 5e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,N,K,splits", CPU_CASES)
def test_fallback_dgrad_matches_oracle(fmt, E, N, K, splits):
    """The CPU fallback dgrad equals ``dy`` times the dequantized experts in fp32."""
    wp, ws = random_packed(fmt, E, N, K, seed=E * K)
    dy = torch.randn(sum(splits), N).bfloat16()
    dx = w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits)
    assert dx.dtype == torch.bfloat16 and dx.shape == (sum(splits), K)
    if dx.numel():
        assert_close(f"dgrad {fmt}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 5e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_autograd_gives_dgrad_and_tensor_splits(fmt):
    """``w4a16_grouped_linear`` backpropagates ``dy . dequant(W)`` to ``x``; tensor ``m_splits`` work too."""
    E, N, K, splits = 3, 40, 64, [4, 0, 6]
    wp, ws = random_packed(fmt, E, N, K, seed=7)
    x = torch.randn(10, K).bfloat16().requires_grad_()
    y = w4a16_grouped_linear(x, wp, ws, fmt, torch.tensor(splits))
    g = torch.randn_like(y)
    y.backward(g)
    assert_close("y", oracle_fwd(x.detach(), wp, ws, fmt, splits), y.detach().float(), 5e-3)
    assert_close("dx", oracle_dgrad(g, wp, ws, fmt, splits), x.grad.float(), 5e-3)


def test_validation_errors_name_the_tensor():
    """Bad dtypes, shapes and splits raise ValueError naming the tensor and the expected value."""
    wp, ws = random_packed(MXFP4_FORMAT, 2, 16, 64)
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(ValueError, match="m_splits sum to 4"):
        w4a16_grouped_gemm(x, wp, ws, MXFP4_FORMAT, [1, 3])
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        w4a16_grouped_gemm(x.float(), wp, ws, MXFP4_FORMAT, [1, 2])
    with pytest.raises(ValueError, match="w_packed must be torch.int32"):
        w4a16_grouped_gemm(x, wp, ws, INT4_FORMAT, [1, 2])
    with pytest.raises(ValueError, match="columns, expected K = 64"):
        w4a16_grouped_gemm(torch.randn(3, 32).bfloat16(), wp, ws, MXFP4_FORMAT, [1, 2])
    with pytest.raises(ValueError, match="one per expert"):
        w4a16_grouped_gemm(x, wp, ws, MXFP4_FORMAT, [3])
    with pytest.raises(ValueError, match="fmt must be"):
        w4a16_grouped_gemm(x, wp, ws, "nvfp4-pack-quantized", [1, 2])
