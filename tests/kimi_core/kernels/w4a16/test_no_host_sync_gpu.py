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


def splits_as(splits: list[int], form: str):
    """``splits`` as Megatron's dispatchers hand them: a list, a CPU tensor (all-to-all) or a device tensor."""
    return list(splits) if form == "list" else torch.tensor(splits, device=form)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", ["list", "cpu", "cuda"])
@pytest.mark.parametrize("path", ["fused", "chunked-2-buffers", "chunked-1-chunk", "gluon"])
def test_w4a16_paths_run_without_a_host_sync(fmt, form, path, monkeypatch):
    """Every path with host splits (a list, a CPU tensor) and with device splits (never read back: the fused offsets
    and the Gluon tile table built on the GPU), except the chunked path over several chunks, which must read device
    splits back to slice its chunks (documented in kimi_core.kernels.w4a16.chunked)."""
    E, K, N = 9, 512, 256
    if path == "gluon" and not (gw.HAVE_GLUON and torch.cuda.get_device_capability(0)[0] == 9):
        pytest.skip("the Gluon kernels need Hopper and Triton >= 3.5")
    if path == "chunked-2-buffers":  # two experts per buffer: five chunks on the side stream, host offsets
        if form == "cuda":
            pytest.skip("several chunks slice rows on the host: device splits are read back (by design)")
        monkeypatch.setenv(wc.WORKSPACE_ENV, str(4 * N * K * 2))
        assert wc.plan_chunks(E, N, K).num_chunks > 1
    splits = ragged_splits(E, 40, seed=3)  # empty experts included
    m = splits_as(splits, form)
    wp, ws = random_packed(fmt, E, N, K, seed=3, device=DEV)
    x = torch.randn(sum(splits), K, device=DEV).bfloat16()
    dy = torch.randn(sum(splits), N, device=DEV).bfloat16()
    chosen = path.split("-")[0]
    y = without_sync(lambda: kernels.w4a16_grouped_gemm(x, wp, ws, fmt, m, path=chosen))
    dx = without_sync(lambda: kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, m, path=chosen))
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["fused", "gluon"])
def test_device_splits_replay_in_a_cuda_graph(fmt, path):
    """With ``m_splits`` a device tensor, forward and dgrad are captured in one CUDA graph once; replayed after the
    splits tensor is rewritten in place (the same total rows, another split, empty experts moved), each replay equals
    the fp32 oracle of the splits it ran with: no split is baked into the graph."""
    if path == "gluon" and not (gw.HAVE_GLUON and torch.cuda.get_device_capability(0)[0] == 9):
        pytest.skip("the Gluon kernels need Hopper and Triton >= 3.5")
    E, K, N = 9, 512, 256
    first = ragged_splits(E, 40, seed=5)
    second = ragged_splits(E, 40, seed=6)
    T = sum(first)
    second[-1] += T - sum(second)  # the same rows in all
    assert second[-1] >= 0 and second != first
    wp, ws = random_packed(fmt, E, N, K, seed=5, device=DEV)
    x = torch.randn(T, K, device=DEV).bfloat16()
    dy = torch.randn(T, N, device=DEV).bfloat16()
    m = torch.tensor(first, device=DEV)
    kernels.w4a16_grouped_gemm(x, wp, ws, fmt, m, path=path)  # compile outside the capture
    kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, m, path=path)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.w4a16_grouped_gemm(x, wp, ws, fmt, m, path=path)
        dx = kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, m, path=path)
    for splits in (first, second):
        m.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(f"{path} graph fwd {splits}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)
        assert_close(f"{path} graph dgrad {splits}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)
