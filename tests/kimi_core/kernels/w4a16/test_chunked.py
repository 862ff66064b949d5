"""Chunked dequantize-then-GEMM path and the dispatcher, on CPU: plans, the stream protocol, results vs the oracle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from utils import assert_close

from kimi_core import kernels
from kimi_core.kernels.w4a16 import chunked as wc

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, oracle_dgrad, oracle_fwd, random_packed


# ---------------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize(
    "E,N,K,op,experts",
    [
        pytest.param(112, 6144, 3584, "fwd", None, id="K3-fc1-default-1GiB"),
        pytest.param(24, 4096, 7168, "dgrad", None, id="K2-fc1-dgrad-default"),
        pytest.param(7, 40, 96, "fwd", 7, id="whole-layer-fits"),
        pytest.param(7, 40, 96, "fwd", 4, id="two-buffers-of-2"),
        pytest.param(7, 40, 96, "fwd", 1.5, id="one-buffer-of-1"),
        pytest.param(5, 13, 64, "dgrad", 2, id="dgrad-N13-padded-to-16"),
    ],
)
def test_plan_stays_within_bound(E, N, K, op, experts):
    """Chunks cover the experts in order, differ in size by at most one, and their workspace fits the bound."""
    n_out = N if op == "fwd" else -(-N // 8) * 8
    bound = None if experts is None else int(experts * n_out * K * 2)
    plan = wc.plan_chunks(E, N, K, op, bound)
    sizes = [b - a for a, b in zip(plan.bounds, plan.bounds[1:])]
    assert plan.bounds[0] == 0 and plan.bounds[-1] == E and min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1 and max(sizes) == plan.per_buffer
    assert plan.n_out == n_out and plan.n_out % (1 if op == "fwd" else 8) == 0
    assert plan.workspace_bytes <= wc.workspace_bound(bound)
    if experts is not None and experts >= E:
        assert plan.num_chunks == 1
    if experts is not None and experts < 2:
        assert plan.buffers == 1 and plan.per_buffer == 1
    if experts is None:
        assert plan.buffers == 2 and plan.num_chunks > 1


def test_plan_errors_and_env_bound(monkeypatch):
    """An expert larger than the bound is refused; the bound comes from the environment and is validated."""
    with pytest.raises(ValueError, match="more than the workspace bound"):
        wc.plan_chunks(4, 64, 64, "fwd", 64 * 64 * 2 - 1)
    monkeypatch.setenv(wc.WORKSPACE_ENV, str(3 * 64 * 64 * 2))
    assert wc.plan_chunks(8, 64, 64).bounds == tuple(range(9))  # two buffers of one expert
    assert not wc.fits(64, 65 * 32)
    monkeypatch.setenv(wc.WORKSPACE_ENV, "1GiB")
    with pytest.raises(ValueError, match=wc.WORKSPACE_ENV):
        wc.workspace_bound()


# ------------------------------------------------------------------------------------- the stream protocol
class TracingStreams(wc.InlineStreams):
    """Two modelled CUDA streams with vector clocks: which queued ops must finish before each decode / GEMM."""

    def __init__(self, drop_side_waits: bool = False):
        self.count = {"main": 0, "side": 0}
        self.clock = {s: {"main": 0, "side": 0} for s in self.count}  # ops of each stream the next op waits for
        self.ops = []  # (where, op, chunk, buf, index, deps)
        self.drop_side_waits = drop_side_waits

    def fork(self):
        self.wait("side", self.record("main"))

    def record(self, where):
        return dict(self.clock[where])

    def wait(self, where, token):
        if token is None or (self.drop_side_waits and where == "side"):
            return
        self.clock[where] = {s: max(self.clock[where][s], token[s]) for s in token}

    def note(self, where, op, chunk, buf):
        index = self.count[where]
        self.ops.append((where, op, chunk, buf, index, dict(self.clock[where])))
        self.count[where] += 1
        self.clock[where][where] = self.count[where]

    def check(self):
        """Every GEMM waits for its chunk's decode; every decode waits for the GEMMs that read its buffer before."""
        decodes = {c: (w, i, b) for w, op, c, b, i, _ in self.ops if op == "decode"}
        for pos, (where, op, c, b, _i, deps) in enumerate(self.ops):
            if op == "gemm":
                dw, di, db = decodes[c]
                assert db == b, f"chunk {c}: decoded into buffer {db}, read from {b}"
                assert deps[dw] > di or dw == where, f"GEMM of chunk {c} does not wait for its decode"
            else:
                for w2, op2, c2, b2, i2, _ in self.ops[:pos]:
                    if op2 == "gemm" and b2 == b:
                        assert deps[w2] > i2 or w2 == where, (
                            f"decode of chunk {c} overwrites buffer {b} under GEMM {c2}"
                        )
        assert self.clock["main"]["side"] == self.count["side"], "the current stream does not wait for every decode"


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_pipeline_orders_decodes_and_gemms(n, buffers):
    """For any chunk count the schedule keeps decode -> GEMM order and never reuses a buffer under a GEMM."""
    tr = TracingStreams()
    done = []
    wc.pipeline(list(range(n)), buffers, lambda c, b: done.append(("d", c)), lambda c, b: done.append(("g", c)), tr)
    tr.check()
    assert [c for k, c in done if k == "g"] == list(range(n))


def test_tracer_catches_a_missing_wait():
    """The tracer is not vacuous: dropping the side stream's waits makes it fail."""
    tr = TracingStreams(drop_side_waits=True)
    wc.pipeline([0, 1, 2], 2, lambda c, b: None, lambda c, b: None, tr)
    with pytest.raises(AssertionError, match="overwrites"):
        tr.check()


# ----------------------------------------------------------------------------------------- chunked results
CASES = [  # E, N, K, splits, workspace in experts (None: 1 GiB)
    pytest.param(5, 64, 96, [3, 0, 7, 0, 5], None, id="E5-whole-layer-ragged-empty"),
    pytest.param(5, 64, 96, [3, 0, 7, 0, 5], 2, id="E5-ws2-five-chunks"),
    pytest.param(7, 40, 160, [5, 0, 0, 0, 0, 3, 0], 4, id="E7-ws4-empty-chunks-skipped"),
    pytest.param(7, 40, 160, [9, 1, 4, 0, 2, 6, 11], 1.5, id="E7-one-buffer"),
    pytest.param(6, 13, 64, [2, 5, 0, 1, 8, 3], 3, id="N13-dgrad-padding"),
    pytest.param(3, 32, 64, [0, 0, 0], 2, id="all-empty"),
    pytest.param(4, 24, 256, [0, 17, 0, 1], 2, id="leading-trailing-empty"),
]


def _bound(experts, N, K):
    return None if experts is None else int(experts * (-(-N // 8) * 8) * K * 2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,N,K,splits,experts", CASES)
def test_chunked_matches_oracle(fmt, E, N, K, splits, experts):
    """Forward and dgrad over chunk boundaries, with the schedule traced, equal the fp32 oracle."""
    wp, ws = random_packed(fmt, E, N, K, seed=E + N + K)
    T = sum(splits)
    x, dy = torch.randn(T, K).bfloat16(), torch.randn(T, N).bfloat16()
    bound = _bound(experts, N, K)
    for op, a, fn, oracle in (
        ("fwd", x, wc.grouped_gemm, oracle_fwd),
        ("dgrad", dy, wc.grouped_gemm_dgrad, oracle_dgrad),
    ):
        tr = TracingStreams()
        got = fn(a, wp, ws, fmt, splits, workspace_bytes=bound, streams=tr)
        tr.check()
        assert got.dtype == torch.bfloat16 and got.shape == (T, N if op == "fwd" else K) and got.is_contiguous()
        if T:
            assert_close(f"{op} {fmt}", oracle(a, wp, ws, fmt, splits), got.float(), 5e-3)
        chunks = wc.plan_chunks(E, N, K, op, bound).num_chunks
        gemms = sum(1 for o in tr.ops if o[1] == "gemm")
        assert gemms <= chunks and (gemms > 0) == (T > 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_tensor_splits_and_out(fmt):
    """Integer-tensor m_splits and a preallocated ``out`` give the same result as a list and a fresh tensor."""
    E, N, K, splits = 5, 48, 128, [4, 0, 9, 2, 0]
    wp, ws = random_packed(fmt, E, N, K, seed=3)
    x = torch.randn(15, K).bfloat16()
    bound = _bound(2, N, K)
    ref = wc.grouped_gemm(x, wp, ws, fmt, splits, workspace_bytes=bound)
    out = torch.full((15, N), float("nan"), dtype=torch.bfloat16)
    got = wc.grouped_gemm(x, wp, ws, fmt, torch.tensor(splits), out=out, workspace_bytes=bound)
    assert got is out and torch.equal(got, ref)


# --------------------------------------------------------------------------------------------- dispatcher
@pytest.mark.parametrize("fmt", FORMATS)
def test_public_api_forced_chunked_on_cpu(fmt, monkeypatch):
    """``path="chunked"`` (or KIMI_W4A16_PATH) runs the chunked path on CPU; autograd's dgrad follows it."""
    E, N, K, splits = 4, 40, 96, [6, 0, 3, 5]
    wp, ws = random_packed(fmt, E, N, K, seed=9)
    monkeypatch.setenv(wc.WORKSPACE_ENV, str(2 * N * K * 2))  # two chunks of one expert per buffer
    calls = []
    real = wc._grouped
    monkeypatch.setattr(wc, "_grouped", lambda *a, **k: calls.append(a[7]) or real(*a, **k))
    x = torch.randn(14, K).bfloat16().requires_grad_()
    y = kernels.w4a16_grouped_linear(x, wp, ws, fmt, splits, path="chunked")
    g = torch.randn_like(y)
    y.backward(g)
    assert calls == ["fwd", "dgrad"]
    assert_close("y", oracle_fwd(x.detach(), wp, ws, fmt, splits), y.detach().float(), 5e-3)
    assert_close("dx", oracle_dgrad(g, wp, ws, fmt, splits), x.grad.float(), 5e-3)
    monkeypatch.setenv(kernels.PATH_ENV, "chunked")
    kernels.w4a16_grouped_gemm(x.detach(), wp, ws, fmt, splits)
    assert calls[-1] == "fwd" and len(calls) == 3
    kernels.w4a16_grouped_gemm(x.detach(), wp, ws, fmt, splits, path="fused")  # the argument wins: reference
    assert len(calls) == 3


# ------------------------------------------------------------------------------ Triton decode, interpreted
_INTERP_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, sys.argv[1])
from w4a16_cases import oracle_fwd, oracle_dgrad, random_packed
from kimi_core.quant import dequantize, int4
from kimi_core.kernels.w4a16 import chunked as wc
from kimi_core.kernels.w4a16.dequant_experts import decode_experts

def trunc_bf16(v):  # the interpreter casts fp32 -> bf16 by truncation
    return (v.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

E, N, K = 4, 13, 160
for fmt in ("mxfp4-pack-quantized", "pack-quantized"):
    # E8M0 bytes from 2: the interpreter flushes fp32 subnormal products (bytes 0 and 1) to zero; the GPU test
    # covers 0..254
    wp, ws = random_packed(fmt, E, N, K, seed=2, scale_range=(2, 254))
    out = torch.full((3, 16, K), float("nan"), dtype=torch.bfloat16)
    decode_experts(wp, ws, fmt, 1, 3, out)
    if fmt.startswith("mxfp4"):  # products of E2M1 and powers of two are exact: no rounding to differ in
        ref = dequantize(fmt, wp[1:4], ws[1:4], torch.bfloat16)
    else:
        q = int4.unpack(wp[1:4]).float().reshape(3, N, K // 32, 32)
        ref = trunc_bf16(q * ws[1:4].float().unsqueeze(-1)).reshape(3, N, K)
    assert torch.equal(out[:, :N].view(torch.int16), ref.view(torch.int16)), fmt
    assert (out[:, N:].float() == 0).all(), fmt
    splits = [3, 0, 7, 5]
    wp, ws = random_packed(fmt, E, N, K, seed=5)
    x, dy = torch.randn(15, K).bfloat16(), torch.randn(15, N).bfloat16()
    bound = 2 * 16 * K * 2
    for got, ref in ((wc.grouped_gemm(x, wp, ws, fmt, splits, workspace_bytes=bound),
                      oracle_fwd(x, wp, ws, fmt, splits)),
                     (wc.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, workspace_bytes=bound),
                      oracle_dgrad(dy, wp, ws, fmt, splits))):
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (fmt, err)
print("OK")
"""


def test_triton_decode_in_interpreter():
    """The Triton decode kernel is bit-exact (MXFP4; INT4 up to the interpreter's truncating cast), zero-pads rows,
    and drives the chunked path under TRITON_INTERPRET on CPU."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT, here],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here)))),
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
