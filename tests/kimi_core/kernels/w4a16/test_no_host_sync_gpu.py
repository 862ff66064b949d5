"""No W4A16 path (nor the BF16 grouped GEMM beside it) makes the host wait for the GPU when ``m_splits`` is a host
list, as Megatron's dispatcher passes it: a hidden sync per call (a pageable host-to-device copy of the tile table)
made the Gluon call's host time the GPU's and took away the host's run-ahead in a training step. Checked with torch's sync debug mode, which raises on a synchronizing copy;
each result is also checked against the float32 oracle (run on the GPU machine, never in CI)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_close

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, oracle_dgrad, oracle_fwd, ragged_splits, random_packed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kimi_core import kernels
from kimi_core.kernels.bf16_grouped import bf16_grouped_linear
from kimi_core.kernels.w4a16 import chunked as wc
from kimi_core.kernels.w4a16 import gluon as gw
from kimi_core.quant import dequantize

DEV = "cuda"


def without_sync(fn):
    """``fn()`` once to compile, then again under sync debug mode "error" (a synchronizing op raises)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["fused", "chunked-2-buffers", "gluon"])
def test_w4a16_paths_run_without_a_host_sync(fmt, path, monkeypatch):
    E, K, N = 9, 512, 256
    if path == "gluon" and not (gw.HAVE_GLUON and torch.cuda.get_device_capability(0)[0] == 9):
        pytest.skip("the Gluon kernels need Hopper and Triton >= 3.5")
    if path.startswith("chunked"):  # two experts per buffer: five chunks on the side stream, host offsets
        monkeypatch.setenv(wc.WORKSPACE_ENV, str(4 * N * K * 2))
        assert wc.plan_chunks(E, N, K).num_chunks > 1
    splits = ragged_splits(E, 40, seed=3)  # a host list, empty experts included
    wp, ws = random_packed(fmt, E, N, K, seed=3, device=DEV)
    x = torch.randn(sum(splits), K, device=DEV).bfloat16()
    dy = torch.randn(sum(splits), N, device=DEV).bfloat16()
    chosen = path.split("-")[0]
    y = without_sync(lambda: kernels.w4a16_grouped_gemm(x, wp, ws, fmt, splits, path=chosen))
    dx = without_sync(lambda: kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits, path=chosen))
    assert_close(f"{path} fwd", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)
    assert_close(f"{path} dgrad", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)


def test_bf16_grouped_linear_runs_without_a_host_sync():
    E, K, N = 9, 512, 256
    splits = ragged_splits(E, 40, seed=4)
    wp, ws = random_packed(FORMATS[0], E, N, K, seed=4, device=DEV)
    w = dequantize(FORMATS[0], wp, ws, torch.bfloat16)  # [E, N, K]
    x = torch.randn(sum(splits), K, device=DEV).bfloat16()
    y = without_sync(lambda: bf16_grouped_linear(x, w, splits))
    assert_close("bf16 grouped", oracle_fwd(x, wp, ws, FORMATS[0], splits), y.float(), 1e-2)
