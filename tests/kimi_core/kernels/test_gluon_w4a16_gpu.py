"""The experimental warp-specialised Gluon W4A16 forward and dgrad (``kimi_core.kernels.gluon_w4a16``, issue #21) on a
Hopper GPU against the float32 oracle of exactly dequantized weights (run on the H200, never in CI)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from utils import assert_close

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, oracle_dgrad, oracle_fwd, ragged_splits, random_packed  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability(0)[0] != 9:
    pytest.skip("the Gluon kernel is written for Hopper (wgmma)", allow_module_level=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N,mean", [
    pytest.param(112, 3584, 6144, 128, id="K3-fc1-128tok"),
    pytest.param(24, 2048, 7168, 8, id="K2-fc2-8tok"),
    pytest.param(7, 512, 200, 70, id="K512-N200-masked-N"),
])
def test_gluon_fwd_and_dgrad_match_oracle(fmt, E, K, N, mean):
    from kimi_core.kernels import gluon_w4a16 as gw

    if not gw.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    splits = ragged_splits(E, mean, seed=E)
    assert 0 in splits, "the case must cover empty experts"
    wp, ws = random_packed(fmt, E, N, K, seed=1, device="cuda")
    T = sum(splits)
    x = torch.randn(T, K, device="cuda").bfloat16()
    dy = torch.randn(T, N, device="cuda").bfloat16()
    y = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison: unwritten rows show
    dx = torch.full((T, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    gw.grouped_gemm(x, wp, ws, fmt, splits, out=y)
    gw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, out=dx)
    torch.cuda.synchronize()
    assert_close(f"gluon fwd {fmt} E{E} K{K} N{N} T{T}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)
    assert_close(f"gluon dgrad {fmt} E{E} K{K} N{N} T{T}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)
