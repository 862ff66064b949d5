"""The W4A16 dispatcher (:mod:`kimi_core.kernels.w4a16.dispatch`): forced paths, the auto choice from its tables,
and the options the ``"gluon"`` path passes, on the CPU (a CUDA device of compute capability 9.0 stood in)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kimi_core import kernels
from kimi_core.kernels.w4a16 import chunked as wc
from kimi_core.kernels.w4a16 import dispatch

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import MXFP4, random_packed


def _needs_gluon():
    from kimi_core.kernels.w4a16.gluon import HAVE_GLUON

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")


def test_forced_gluon_path_reaches_the_kernel_and_refuses_a_cpu_tensor(monkeypatch):
    """``path="gluon"`` / ``KIMI_W4A16_PATH=gluon`` is a forced path of the public ops (forward and autograd's dgrad),
    on any shape; on a tensor off the GPU the kernel says it runs on Hopper only."""
    _needs_gluon()
    assert kernels.choose_path("dgrad", 16, 2, 256, 512, "cpu", path="gluon") == "gluon"
    wp, ws = random_packed(MXFP4, 2, 256, 512)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"w4a16.gluon.grouped_gemm: runs on Hopper GPUs only .* x is on cpu"):
        kernels.w4a16_grouped_gemm(x, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setenv(kernels.PATH_ENV, "gluon")
    with pytest.raises(RuntimeError, match=r"w4a16.gluon.grouped_gemm_dgrad: runs on Hopper GPUs only .* dy is on cpu"):
        kernels.w4a16_grouped_gemm_dgrad(torch.zeros(16, 256, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8])


def test_auto_picks_gluon_only_inside_its_measured_range(monkeypatch):
    """A ``W4A16_GLUON`` range ``[from, to)`` of mean tokens per expert wins over the fused / chunked table (an
    ``(N, K)`` row over ``"default"``), only on shapes the Gluon kernels take (K a multiple of 64, N of 8) and only
    on Hopper (compute capability 9.x: wgmma)."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    monkeypatch.setattr(dispatch, "W4A16_GLUON", {"fwd": {"default": None}, "dgrad": {"default": None}})
    cuda = torch.device("cuda:0")
    E, N, K = 112, 6144, 3584
    assert kernels.choose_path("fwd", E * 128, E, N, K, cuda) == "fused"  # no range: never
    monkeypatch.setitem(dispatch.W4A16_GLUON["fwd"], "default", (0, 512))
    picks = [kernels.choose_path("fwd", E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
    assert picks == ["gluon", "gluon", "chunked", "chunked"]
    assert kernels.choose_path("dgrad", E * 8, E, N, K, cuda) == "fused"  # per op
    assert kernels.choose_path("fwd", E * 8, E, N, 2080, cuda) == "fused"  # K = 2080 is no multiple of 64
    assert kernels.choose_path("fwd", E * 8, E, 6148, K, cuda) == "fused"  # N = 6148 is no multiple of 8
    assert kernels.choose_path("fwd", E * 8, E, N, K, "cpu") == "fused"
    monkeypatch.setitem(dispatch.W4A16_GLUON["fwd"], (N, K), (128, None))
    picks = [kernels.choose_path("fwd", E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
    assert picks == ["fused", "gluon", "gluon", "gluon"]
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 0))  # no wgmma: never Gluon
    picks = [kernels.choose_path("fwd", E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
    assert picks == ["fused", "fused", "chunked", "chunked"]


@pytest.mark.parametrize(
    "op,N,K,want",
    [
        # the fastest path of each benchmark row at 8 / 128 / 512 / 2048 tokens per expert in the format the model
        # ships (docs/performance.md#w4a16-dispatch)
        ("fwd", 6144, 3584, ["fused", "gluon", "gluon", "gluon"]),  # K3 fc1
        ("fwd", 3584, 3072, ["fused", "gluon", "gluon", "gluon"]),  # K3 fc2
        ("fwd", 4096, 7168, ["fused", "gluon", "gluon", "gluon"]),  # K2 fc1
        ("fwd", 7168, 2048, ["fused", "gluon", "gluon", "gluon"]),  # K2 fc2
        ("dgrad", 6144, 3584, ["fused", "gluon", "gluon", "gluon"]),
        ("dgrad", 4096, 7168, ["fused", "gluon", "gluon", "gluon"]),
        ("dgrad", 7168, 2048, ["fused", "gluon", "gluon", "gluon"]),
        # not in the benchmark table: the rule from the kernels' constraints gives them the same picks
        ("fwd", 512, 512, ["fused", "gluon", "gluon", "gluon"]),  # the demos' small K3 fc1
        ("dgrad", 3584, 384, ["fused", "gluon", "gluon", "gluon"]),  # K3 fc2 at expert TP 8
        # K no multiple of 64: no Gluon; fused up to the crossover, then chunked
        ("fwd", 512, 480, ["fused", "fused", "chunked", "chunked"]),
    ],
)
def test_shipped_tables_pick_the_measured_fastest_path(monkeypatch, op, N, K, want):
    """The dispatcher's shipped tables reproduce the benchmark's per-row winner (fused at 8 tokens per expert
    everywhere; the register-fragment Gluon kernels from 128, forward and dgrad); a shape outside the benchmark gets
    the same rule wherever the Gluon kernels take it, else the fused / chunked table."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    E = 112
    got = [kernels.choose_path(op, E * tpe, E, N, K, torch.device("cuda:0")) for tpe in (8, 128, 512, 2048)]
    assert got == want


def test_gluon_options_reach_each_op_of_the_register_kernel(monkeypatch):
    """``GLUON_OPTIONS`` holds the keyword arguments the ``"gluon"`` path passes, per op: each op's entry reaches its
    own entry point of the register kernel (an option it refuses names that entry point; the shipped options reach
    its refusal of a CPU tensor)."""
    _needs_gluon()
    wp, ws = random_packed(MXFP4, 2, 256, 512)
    dy = torch.zeros(16, 256, dtype=torch.bfloat16)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "dgrad", {"decode_ahead": True, "block_n": 256})
    with pytest.raises(ValueError, match=r"w4a16.gluon.grouped_gemm_dgrad: decode_ahead runs on 128-column tiles"):
        kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "fwd", {"block_n": 192})
    with pytest.raises(ValueError, match=r"w4a16.gluon.grouped_gemm: block_n must be one of"):
        kernels.w4a16_grouped_gemm(x, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"w4a16.gluon.grouped_gemm_dgrad: runs on Hopper GPUs only"):
        kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, MXFP4, [8, 8], path="gluon")
    with pytest.raises(RuntimeError, match=r"w4a16.gluon.grouped_gemm: runs on Hopper GPUs only"):
        kernels.w4a16_grouped_gemm(x, wp, ws, MXFP4, [8, 8], path="gluon")


def test_choose_path_table(monkeypatch):
    """Auto picks fused below the crossover and chunked from it (sm90+ CUDA only; the Gluon ranges switched off
    here, see test_shipped_tables_pick_the_measured_fastest_path); forcing and bad values work."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    monkeypatch.delenv(wc.WORKSPACE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "W4A16_GLUON", {"fwd": {"default": None}, "dgrad": {"default": None}})
    cuda = torch.device("cuda:0")
    for E, K, N in ((112, 3584, 6144), (112, 3072, 3584), (24, 7168, 4096), (24, 2048, 7168)):
        for op in ("fwd", "dgrad"):
            picks = [kernels.choose_path(op, E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
            assert picks == ["fused", "fused", "chunked", "chunked"], (E, K, N, op, picks)
    assert kernels.choose_path("fwd", 112 * 2048, 112, 6144, 3584, "cpu") == "fused"
    assert kernels.choose_path("fwd", 0, 0, 64, 64, cuda) == "fused"
    monkeypatch.setitem(kernels.W4A16_CROSSOVER["fwd"], (64, 64), 4)
    assert kernels.choose_path("fwd", 40, 8, 64, 64, cuda) == "chunked"  # a per-shape row
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    assert kernels.choose_path("fwd", 112 * 2048, 112, 6144, 3584, cuda) == "fused"
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "W4A16_GLUON", {"fwd": {"default": None}, "dgrad": {"default": None}})
    monkeypatch.setenv(wc.WORKSPACE_ENV, str(1 << 20))  # one K3 expert (44 MB) no longer fits
    assert kernels.choose_path("fwd", 112 * 2048, 112, 6144, 3584, cuda) == "fused"
    monkeypatch.setenv(kernels.PATH_ENV, "chunked")
    assert kernels.choose_path("fwd", 8, 1, 64, 64, "cpu") == "chunked"
    assert kernels.choose_path("fwd", 8, 1, 64, 64, "cpu", path="auto") == "fused"
    monkeypatch.setenv(kernels.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="KIMI_W4A16_PATH must be one of fused, chunked, gluon, auto"):
        kernels.choose_path("fwd", 8, 1, 64, 64, "cpu")
    with pytest.raises(ValueError, match="path must be one of"):
        kernels.choose_path("fwd", 8, 1, 64, 64, "cpu", path="triton")
