"""Every path the W4A16 dispatcher can choose, on the GPU, against the float32 oracle (run on the H200, never in CI).

Covers the chunked dequantize-then-``_grouped_mm`` path (one chunk, two ping-pong buffers, one buffer), the fused
kernels and auto, forward / dgrad / autograd, MXFP4 and INT4, ragged and empty experts, device ``m_splits``, odd
sizes, the decode kernel bit for bit, the workspace bound and the side-stream ordering.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_close

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import (
    FORMATS,
    MXFP4,
    assert_close_streamed,
    oracle_dgrad,
    oracle_fwd,
    ragged_splits,
    random_packed,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kimi_core import kernels
from kimi_core.kernels.w4a16 import chunked as wc
from kimi_core.quant import dequantize

DEV = "cuda"


def _expert_bytes(N, K, op="dgrad"):
    return wc.workspace_rows(N, op) * K * 2


# workspace sizes, in experts: whole layer (one chunk), 2 buffers of 2, 1 buffer of 1
WORKSPACES = [pytest.param(None, id="ws-default"), pytest.param(4, id="ws-2x2"), pytest.param(1.5, id="ws-1x1")]
SHAPES = [  # E, K, N, mean tokens per expert
    pytest.param(9, 512, 256, 23, id="E9-K512-N256"),
    pytest.param(5, 160, 200, 17, id="K160-N200"),
    pytest.param(7, 384, 100, 31, id="K384-N100-unaligned-N"),
    pytest.param(3, 3584, 6144, 40, id="K3-fc1-width"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N", [13, 256])
def test_decode_kernel_bit_exact(fmt, N):
    """The decode kernel writes exactly ``kimi_core.quant.dequantize`` (E8M0 scales 0..254) and zero padding rows."""
    from kimi_core.kernels.w4a16.dequant_experts import decode_experts

    E, K = 6, 1056
    wp, ws = random_packed(fmt, E, N, K, seed=N, device=DEV, scale_range=(0, 254))
    out = torch.full((4, N + 11, K), float("nan"), dtype=torch.bfloat16, device=DEV)
    decode_experts(wp, ws, fmt, 1, 4, out)
    ref = dequantize(fmt, wp[1:5], ws[1:5], torch.bfloat16)
    bad = out[:, :N].view(torch.int16) != ref.view(torch.int16)
    if bad.any() and fmt == MXFP4:  # say which E8M0 scale bytes decode wrongly
        groups = bad.reshape(4, N, K // 32, 32).any(-1)
        print("mismatching scale bytes:", sorted(set(ws[1:5][groups].tolist()))[:20])
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} weights differ from kimi_core.quant.dequantize"
    assert torch.equal(out[:, N:], torch.zeros_like(out[:, N:]))


#: (path, workspace bound in experts): the fused kernel has no workspace, so it runs once
PATH_WORKSPACES = [pytest.param("fused", None, id="fused")] + [
    pytest.param(path, ws.values[0], id=f"{path}-{ws.id}") for path in ("chunked", "auto") for ws in WORKSPACES
]


@pytest.mark.parametrize("path,workspace", PATH_WORKSPACES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N,mean", SHAPES)
@pytest.mark.parametrize("device_splits", [False, True], ids=["host-splits", "device-splits"])
def test_paths_match_oracle(path, workspace, fmt, E, K, N, mean, device_splits, monkeypatch):
    """Forward, dgrad and autograd of the public ops on every path and workspace size equal the fp32 oracle."""
    if workspace is not None:
        monkeypatch.setenv(wc.WORKSPACE_ENV, str(int(workspace * _expert_bytes(N, K))))
    splits = ragged_splits(E, mean, seed=E + K + N)
    T = sum(splits)
    wp, ws = random_packed(fmt, E, N, K, seed=K + N, device=DEV)
    ms = torch.tensor(splits, device=DEV) if device_splits else splits
    x = torch.randn(T, K, device=DEV).bfloat16().requires_grad_()
    g = torch.randn(T, N, device=DEV).bfloat16()
    y = kernels.w4a16_grouped_linear(x, wp, ws, fmt, ms, path=path)
    y.backward(g)
    dx2 = kernels.w4a16_grouped_gemm_dgrad(g, wp, ws, fmt, ms, path=path)
    torch.cuda.synchronize()
    name = f"{path} {fmt} E{E} K{K} N{N} T{T}"
    assert_close(f"fwd {name}", oracle_fwd(x.detach(), wp, ws, fmt, splits), y.detach().float(), 1e-2)
    ref_dx = oracle_dgrad(g, wp, ws, fmt, splits)
    assert_close(f"autograd dx {name}", ref_dx, x.grad.float(), 1e-2)
    assert_close(f"dgrad {name}", ref_dx, dx2.float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "K,N,fwd_path,dgrad_path",
    [
        (3584, 6144, "gluon", "gluon"),
        (2048, 7168, "gluon", "gluon"),
        (7168, 4096, "gluon", "gluon"),
        (2048, 4608, "chunked", "chunked"),
    ],
    ids=["K3-fc1", "K2-fc2", "K2-fc1", "not-measured"],
)
def test_auto_on_a_real_width_layer(fmt, K, N, fwd_path, dgrad_path):
    """At ~2100 tokens/expert over 112 experts auto follows the measured table: the Gluon register kernels, forward
    and dgrad, on the measured K3 / K2 shapes, chunked (several 1 GiB chunks) on a shape the Gluon table does not
    name; each equals the oracle."""
    E = 112
    splits = ragged_splits(E, 3000, seed=1)  # mean 2148 after the empty experts: above the 512 crossover
    T = sum(splits)
    assert kernels.choose_path("fwd", T, E, N, K, torch.device(DEV)) == fwd_path
    assert kernels.choose_path("dgrad", T, E, N, K, torch.device(DEV)) == dgrad_path
    assert kernels.choose_path("fwd", 8 * E, E, N, K, torch.device(DEV)) == "fused"
    if "chunked" in (fwd_path, dgrad_path):
        assert wc.plan_chunks(E, N, K, "fwd" if fwd_path == "chunked" else "dgrad").num_chunks > 2
    wp, ws = random_packed(fmt, E, N, K, seed=2, device=DEV)
    x = torch.randn(T, K, device=DEV).bfloat16()
    dy = torch.randn(T, N, device=DEV).bfloat16()
    y = kernels.w4a16_grouped_gemm(x, wp, ws, fmt, torch.tensor(splits, device=DEV))
    dx = kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits)
    # compared expert by expert: the whole fp32 oracle and its float64 comparison would not fit an 80 GB card
    assert_close_streamed(f"fwd {fwd_path} N{N} K{K} {fmt}", "fwd", x, wp, ws, fmt, splits, y, 1e-2)
    assert_close_streamed(f"dgrad {dgrad_path} N{N} K{K} {fmt}", "dgrad", dy, wp, ws, fmt, splits, dx, 1e-2)


def test_chunked_equals_bf16_grouped_mm():
    """With exact decode, the chunked path is BF16 ``_grouped_mm`` of the dequantized layer (bit for bit unless
    cuBLAS/CUTLASS picks another tile for the smaller chunk problems)."""
    E, K, N = 12, 1024, 768
    splits = ragged_splits(E, 64, seed=4)
    wp, ws = random_packed(MXFP4, E, N, K, seed=4, device=DEV)
    w = dequantize(MXFP4, wp, ws, torch.bfloat16)
    x = torch.randn(sum(splits), K, device=DEV).bfloat16()
    offs = torch.tensor(splits, device=DEV).cumsum(0).to(torch.int32)
    ref = torch._grouped_mm(x, w.transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)
    got = wc.grouped_gemm(x, wp, ws, MXFP4, splits, workspace_bytes=4 * N * K * 2)
    print("bit-identical to BF16 _grouped_mm:", torch.equal(got, ref))
    assert_close("chunked vs BF16 _grouped_mm", ref.float(), got.float(), 1e-3)


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_workspace_bound_respected(op):
    """A 256 MiB layer under a 48 MiB bound never allocates more than the workspace, the output and one chunk's rows."""
    E, K, N = 32, 2048, 2048
    bound = 48 << 20
    splits = ragged_splits(E, 64, seed=7)
    T = sum(splits)
    wp, ws = random_packed(MXFP4, E, N, K, seed=7, device=DEV)
    a = torch.randn(T, K if op == "fwd" else N, device=DEV).bfloat16()
    fn = wc.grouped_gemm if op == "fwd" else wc.grouped_gemm_dgrad
    fn(a, wp, ws, MXFP4, splits, workspace_bytes=bound)  # warm-up: Triton compile, side stream
    plan = wc.plan_chunks(E, N, K, op, bound)
    assert plan.num_chunks > 2 and plan.workspace_bytes <= bound
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(a, wp, ws, MXFP4, splits, workspace_bytes=bound)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    out_bytes = out.numel() * 2
    chunk_rows = max(sum(splits[a_:b_]) for a_, b_ in zip(plan.bounds, plan.bounds[1:]))
    chunk_out = chunk_rows * out.shape[1] * 2
    slack = 2 << 20  # offsets, allocator rounding
    print(
        f"{op}: peak extra {extra / 2**20:.1f} MiB, workspace {plan.workspace_bytes / 2**20:.1f} MiB, "
        f"output {out_bytes / 2**20:.1f} MiB, chunk output {chunk_out / 2**20:.1f} MiB"
    )
    assert extra <= plan.workspace_bytes + out_bytes + 2 * chunk_out + slack
    assert extra < E * N * K * 2 // 4  # nowhere near a bf16 copy of the layer


def test_side_stream_ordering_under_back_to_back_calls():
    """Calls queued back to back on a user stream, weights changing in between, never read a stale workspace."""
    E, K, N = 16, 1024, 1024
    splits = ragged_splits(E, 48, seed=3)
    T = sum(splits)
    bound = 4 * N * K * 2  # two buffers of two experts: 4 chunks
    layers = [random_packed(fmt, E, N, K, seed=s, device=DEV) + (fmt,) for s, fmt in enumerate(FORMATS * 2)]
    x = torch.randn(T, K, device=DEV).bfloat16()
    refs = [oracle_fwd(x, wp, ws, fmt, splits) for wp, ws, fmt in layers]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [wc.grouped_gemm(x, wp, ws, fmt, splits, workspace_bytes=bound) for wp, ws, fmt in layers * 3]
    stream.synchronize()
    for i, y in enumerate(outs):
        assert_close(f"call {i}", refs[i % len(layers)], y.float(), 1e-2)


def test_single_chunk_device_splits_do_not_sync():
    """A layer that fits the workspace with device ``m_splits`` runs without a device-to-host sync."""
    E, K, N = 8, 512, 256
    splits = torch.tensor(ragged_splits(E, 20, seed=5), device=DEV)
    wp, ws = random_packed(MXFP4, E, N, K, seed=5, device=DEV)
    x = torch.randn(int(splits.sum()), K, device=DEV).bfloat16()
    wc.grouped_gemm(x, wp, ws, MXFP4, splits)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        wc.grouped_gemm(x, wp, ws, MXFP4, splits)
        wc.grouped_gemm_dgrad(torch.randn(x.shape[0], N, device=DEV).bfloat16(), wp, ws, MXFP4, splits)
    finally:
        torch.cuda.set_sync_debug_mode(0)
