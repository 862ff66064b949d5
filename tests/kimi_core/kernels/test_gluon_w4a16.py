"""CPU checks of the experimental Gluon W4A16 kernel's host side (its GPU test: test_gluon_w4a16_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kimi_core.kernels.gluon_w4a16 import tile_table


@pytest.mark.parametrize("splits,block", [([0, 70, 1, 129], 64), ([5], 64), ([0, 0, 3], 16), ([0, 0], 64)])
def test_tile_table_covers_each_experts_rows_once(splits, block):
    """Every row of every expert lies in exactly one tile of that expert, no tile spans more than ``block`` rows
    or crosses into the next expert, and empty experts get none."""
    tiles = tile_table(splits, block, "cpu")
    assert tiles.dtype == torch.int32 and tiles.shape[1] == 3
    owner = []
    for e, m in enumerate(splits):
        owner += [e] * m
    seen = [0] * len(owner)
    for e, lo, end in tiles.tolist():
        hi = min(lo + block, end)
        assert 0 < hi - lo <= block and end == sum(splits[:e + 1]), (e, lo, end)
        for r in range(lo, hi):
            assert owner[r] == e
            seen[r] += 1
    assert seen == [1] * len(owner)


@pytest.mark.parametrize("splits", [[8] * 4, [0, 9, 7], [70, 0, 130], [128] * 3, [2048, 1], [0, 0]])
def test_pick_block_m_is_a_kernel_tile_at_or_above_the_mean_expert(splits):
    """The rows per tile are one of the kernel's compiled choices, at least the mean rows of the non-empty experts
    (or the largest choice), and the smallest such choice."""
    from kimi_core.kernels.gluon_w4a16 import BLOCK_M_CHOICES, pick_block_m

    bm = pick_block_m(splits)
    busy = [m for m in splits if m]
    mean = sum(busy) / len(busy) if busy else max(BLOCK_M_CHOICES)
    assert bm in BLOCK_M_CHOICES
    assert bm >= mean or bm == max(BLOCK_M_CHOICES)
    assert all(b < mean for b in BLOCK_M_CHOICES if b < bm)


@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize("splits", [[8] * 4, [0, 9, 7], [128] * 3, [129, 0, 200], [2048, 1], [600] * 4, [0, 0]])
def test_register_kernel_rows_per_tile_follow_its_column_width(splits, block_n):
    """The register-fragment forward takes 256 rows per tile only with 128-column tiles (the same 128 accumulator
    registers per thread as 128 x 128), and picks it there when the non-empty experts' mean rows exceed 128;
    otherwise it picks as the shared-memory kernel does."""
    from kimi_core.kernels import gluon_w4a16 as gw
    from kimi_core.kernels import gluon_w4a16_rs as rs

    assert rs.block_m_choices(256) == gw.BLOCK_M_CHOICES and rs.block_m_choices(128)[-1] == 256
    bm = rs.pick_block_m(splits, block_n)
    busy = [m for m in splits if m]
    mean = sum(busy) / len(busy) if busy else 0
    assert bm in rs.block_m_choices(block_n)
    if block_n == 128 and mean > 128:
        assert bm == 256
    else:
        assert bm == gw.pick_block_m(splits)
    # its own column pick (the measured one): 128 columns x 256 rows above 128 mean rows, else 256 columns
    assert rs.pick_block_n(splits) == (128 if mean > 128 else 256)


def test_programs_one_per_tile_or_a_capped_persistent_count():
    """One program per work item by default; a persistent count never exceeds the work items; a count below 1 is
    refused naming the argument (``True``, one per SM, needs a GPU and runs in the GPU test)."""
    from kimi_core.kernels.gluon_w4a16 import programs

    assert programs(86016, False, "cpu") == 86016
    assert programs(126, 3, "cpu") == 3
    assert programs(6, 132, "cpu") == 6
    with pytest.raises(ValueError, match="persistent must be a bool or a positive number of programs, got 0"):
        programs(6, 0, "cpu")


@pytest.mark.parametrize("kw,message", [
    (dict(block_n=192), r"block_n must be one of \(128, 256\), got 192"),
    (dict(block_n=256, decode_warps=8), "block_n=256 needs decode_warps=4"),
    (dict(block_m=48), r"block_m must be one of \(8, 16, 32, 64, 128\), got 48"),
    (dict(load_stages=9), "load_stages must be 2 to 8, got 9"),
])
def test_bad_tile_arguments_are_refused_before_any_launch(kw, message):
    """A tile argument outside the compiled choices is refused with the argument's name (on any device: the
    checks run before a descriptor or a launch)."""
    import os
    import sys

    from kimi_core.kernels import gluon_w4a16 as gw

    if not gw.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    sys.path.insert(0, os.path.dirname(__file__))
    from w4a16_cases import MXFP4, random_packed

    wp, ws = random_packed(MXFP4, 2, 256, 512)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        gw.grouped_gemm(x, wp, ws, MXFP4, [8, 8], **kw)


def test_forced_gluon_path_reaches_the_kernel_and_refuses_a_cpu_tensor(monkeypatch):
    """``path="gluon"`` / ``KIMI_W4A16_PATH=gluon`` is a forced path of the public ops (forward and autograd's dgrad),
    on any shape; on a tensor off the GPU the kernel says it runs on Hopper only."""
    import os
    import sys

    from kimi_core import kernels
    from kimi_core.kernels import gluon_w4a16 as gw

    if not gw.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    sys.path.insert(0, os.path.dirname(__file__))
    from w4a16_cases import MXFP4, random_packed

    assert kernels.choose_path("dgrad", 16, 2, 256, 512, "cpu", path="gluon") == "gluon"
    wp, ws = random_packed(MXFP4, 2, 256, 512)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"gluon_w4a16_rs.grouped_gemm: runs on Hopper GPUs only .* x is on cpu"):
        kernels.w4a16_grouped_gemm(x, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setenv(kernels.PATH_ENV, "gluon")
    with pytest.raises(RuntimeError, match=r"gluon_w4a16_rs.grouped_gemm_dgrad: runs on Hopper GPUs only .* dy is on cpu"):
        kernels.w4a16_grouped_gemm_dgrad(torch.zeros(16, 256, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8])


def test_auto_picks_gluon_only_inside_its_measured_range(monkeypatch):
    """A ``W4A16_GLUON`` range ``[from, to)`` of mean tokens per expert wins over the fused / chunked table (an
    ``(N, K)`` row over ``"default"``), only on shapes the Gluon kernels take (K a multiple of 512, N of 8) and only
    on sm90+ CUDA."""
    from kimi_core import kernels

    monkeypatch.setattr(kernels, "_capability", lambda index: (9, 0))
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    monkeypatch.setattr(kernels, "W4A16_GLUON", {"fwd": {"default": None}, "dgrad": {"default": None}})
    cuda = torch.device("cuda:0")
    E, N, K = 112, 6144, 3584
    assert kernels.choose_path("fwd", E * 128, E, N, K, cuda) == "fused"  # no range: never
    monkeypatch.setitem(kernels.W4A16_GLUON["fwd"], "default", (0, 512))
    picks = [kernels.choose_path("fwd", E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
    assert picks == ["gluon", "gluon", "chunked", "chunked"]
    assert kernels.choose_path("dgrad", E * 8, E, N, K, cuda) == "fused"  # per op
    assert kernels.choose_path("fwd", E * 8, E, N, 2880, cuda) == "fused"  # K = 2880 is no multiple of 512
    assert kernels.choose_path("fwd", E * 8, E, N, K, "cpu") == "fused"
    monkeypatch.setitem(kernels.W4A16_GLUON["fwd"], (N, K), (128, None))
    picks = [kernels.choose_path("fwd", E * tpe, E, N, K, cuda) for tpe in (8, 128, 512, 2048)]
    assert picks == ["fused", "gluon", "gluon", "gluon"]


@pytest.mark.parametrize("op,N,K,want", [
    # the fastest path of each benchmark row at 8 / 128 / 512 / 2048 tokens per expert in the format the model
    # ships (benchmarks/RESULTS.md, 2026-12-05: the register kernels, forward and dgrad, against the fused / chunked
    # rows; 2026-12-06: the dgrad at 2048 with the tiled scale transpose)
    ("fwd", 6144, 3584, ["fused", "gluon", "gluon", "gluon"]),    # K3 fc1
    ("fwd", 3584, 3072, ["fused", "gluon", "gluon", "gluon"]),    # K3 fc2
    ("fwd", 4096, 7168, ["fused", "gluon", "gluon", "gluon"]),    # K2 fc1
    ("fwd", 7168, 2048, ["fused", "gluon", "gluon", "gluon"]),    # K2 fc2
    ("dgrad", 6144, 3584, ["fused", "gluon", "gluon", "gluon"]),
    ("dgrad", 4096, 7168, ["fused", "gluon", "gluon", "gluon"]),
    ("dgrad", 7168, 2048, ["fused", "gluon", "gluon", "gluon"]),
    ("fwd", 512, 512, ["fused", "fused", "chunked", "chunked"]),  # not measured (the demos' small K3 fc1)
])
def test_shipped_tables_pick_the_measured_fastest_path(monkeypatch, op, N, K, want):
    """The dispatcher's shipped tables reproduce the benchmark's per-row winner (fused at 8 tokens per expert
    everywhere; the register-fragment Gluon kernels from 128, forward and dgrad); a shape not measured keeps the fused
    / chunked table."""
    from kimi_core import kernels

    monkeypatch.setattr(kernels, "_capability", lambda index: (9, 0))
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    E = 112
    got = [kernels.choose_path(op, E * tpe, E, N, K, torch.device("cuda:0")) for tpe in (8, 128, 512, 2048)]
    assert got == want


def test_gluon_options_name_a_kernel_that_has_the_op(monkeypatch):
    """``GLUON_OPTIONS`` picks the Gluon kernel of the ``"gluon"`` path, per op; an unknown kernel names the table
    entry, and each op reaches its own entry point of the register-fragment kernel (on the CPU: its refusal)."""
    import os
    import sys

    from kimi_core import kernels

    sys.path.insert(0, os.path.dirname(__file__))
    from w4a16_cases import MXFP4, random_packed

    wp, ws = random_packed(MXFP4, 2, 256, 512)
    dy = torch.zeros(16, 256, dtype=torch.bfloat16)
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "dgrad", {"kernel": "shared"})
    with pytest.raises(ValueError, match=r"GLUON_OPTIONS\['dgrad'\]\['kernel'\] must be 'smem' or 'registers'"):
        kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "dgrad", {"kernel": "registers", "decode_ahead": True})
    with pytest.raises(RuntimeError, match=r"gluon_w4a16_rs.grouped_gemm_dgrad: runs on Hopper GPUs only"):
        kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "fwd", {"kernel": "tensor-cores"})
    with pytest.raises(ValueError, match=r"GLUON_OPTIONS\['fwd'\]\['kernel'\] must be 'smem' or 'registers'"):
        kernels.w4a16_grouped_gemm(torch.zeros(16, 512, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8], path="gluon")
    monkeypatch.setitem(kernels.GLUON_OPTIONS, "fwd", {"kernel": "registers", "persistent": True})
    with pytest.raises(RuntimeError, match=r"gluon_w4a16_rs.grouped_gemm: runs on Hopper GPUs only"):
        kernels.w4a16_grouped_gemm(torch.zeros(16, 512, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8], path="gluon")


@pytest.mark.parametrize("kw,match", [
    ({"mma_chunks": 3}, r"mma_chunks must be one of \(1, 2, 4\), got 3"),
    ({"ctas_per_sm": 3}, r"ctas_per_sm must be 1 or 2, got 3"),
    ({"ctas_per_sm": 2, "block_m": 128, "block_n": 128}, r"ctas_per_sm=2 takes tiles of at most 64 rows x 128 "
                                                        r"columns or 32 x 256 .* got block_m 128 x block_n 128"),
    ({"ctas_per_sm": 2, "block_m": 64, "block_n": 256}, r"ctas_per_sm=2 takes .* got block_m 64 x block_n 256"),
    ({"decode_ahead": True, "block_n": 256}, r"decode_ahead runs one wgmma per K step on 128-column tiles .* got "
                                             r"mma_chunks 1, block_n 256"),
    ({"decode_ahead": True, "mma_chunks": 4}, r"decode_ahead runs .* got mma_chunks 4, block_n 128"),
])
def test_register_kernel_refuses_options_it_cannot_run_by_name(kw, match):
    """The register kernel's K slicing (1, 2 or 4 wgmmas per K step), two-programs-per-SM mode and decode ahead are
    refused by name outside what compiles without spills (tests/gpu/gluon_sm90_compile_check.py), before anything launches."""
    import os
    import sys

    from kimi_core.kernels import gluon_w4a16_rs as rs

    sys.path.insert(0, os.path.dirname(__file__))
    from w4a16_cases import MXFP4, random_packed

    wp, ws = random_packed(MXFP4, 2, 256, 512)
    with pytest.raises(ValueError, match=r"gluon_w4a16_rs.grouped_gemm: " + match):
        rs.grouped_gemm(torch.zeros(16, 512, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8], **kw)


@pytest.mark.parametrize("kw,match", [
    ({"block_n": 64}, r"block_n must be one of \(128, 256\), got 64"),
    ({"decode_ahead": True, "block_n": 256}, r"decode_ahead runs on 128-column tiles .* got block_n 256"),
    ({"block_n": 256, "block_m": 256}, r"block_m must be one of \(8, 16, 32, 64, 128\), got 256"),
])
def test_register_dgrad_refuses_options_it_cannot_run_by_name(kw, match):
    """The register-fragment dgrad (``gluon_w4a16_rs.grouped_gemm_dgrad``) refuses tile options it has no compiled
    form for by name, before anything launches (256 rows per tile only with 128 columns, as the forward)."""
    import os
    import sys

    from kimi_core.kernels import gluon_w4a16 as gw
    from kimi_core.kernels import gluon_w4a16_rs as rs

    if not gw.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    sys.path.insert(0, os.path.dirname(__file__))
    from w4a16_cases import MXFP4, random_packed

    wp, ws = random_packed(MXFP4, 2, 256, 512)
    with pytest.raises(ValueError, match=r"gluon_w4a16_rs.grouped_gemm_dgrad: " + match):
        rs.grouped_gemm_dgrad(torch.zeros(16, 256, dtype=torch.bfloat16), wp, ws, MXFP4, [8, 8], **kw)


def test_mxfp4_scale_fold_is_taken_only_where_every_scale_allows_it():
    """``fold_scales`` (MXFP4 decoded with one multiply by ``2^(s - 1)``, a normal bf16 only for E8M0 bytes ``s <=
    128``) runs the folded format id only when every scale byte of the tensor is at most 128, read once per tensor
    version; otherwise, and for INT4, the exact two-multiply decode."""
    from kimi_core.kernels import gluon_w4a16 as gw
    from kimi_core.kernels import gluon_w4a16_rs as rs

    scales = torch.full((2, 8, 16), 128, dtype=torch.uint8)
    mxfp4, int4 = gw.Launch(out=torch.empty(0), fmt_id=0), gw.Launch(out=torch.empty(0), fmt_id=1)
    assert gw.kernel_fmt_id(mxfp4.fmt_id, scales, True) == gw.FMT_MXFP4_FOLDED
    assert gw.kernel_fmt_id(mxfp4.fmt_id, scales, False) == 0
    scales[1, 3, 5] = 129  # in place: a new version, read again
    assert gw.kernel_fmt_id(mxfp4.fmt_id, scales, True) == 0
    scales[1, 3, 5] = 0
    assert gw.mxfp4_scales_fold(scales)
    assert gw.kernel_fmt_id(int4.fmt_id, torch.ones(2, 8, 16, dtype=torch.bfloat16), True) == 1


def test_mxfp4_scale_fold_reads_nothing_during_graph_capture(monkeypatch):
    """Reading a scale tensor syncs the device, which a CUDA graph capture forbids: an unread CUDA tensor answers
    False there (the exact two-multiply decode, the same bits) and is read at its first use outside a capture."""
    from kimi_core.kernels import gluon_w4a16 as gw

    class OnCuda(torch.Tensor):  # a CPU tensor that reports a CUDA device, so no GPU is needed
        @property
        def is_cuda(self):
            return True

    scales = torch.full((2, 8, 16), 120, dtype=torch.uint8).as_subclass(OnCuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not gw.mxfp4_scales_fold(scales)
    assert not hasattr(scales, "_kimi_scales_fold"), "nothing may be read or remembered during a capture"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert gw.mxfp4_scales_fold(scales)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gw.mxfp4_scales_fold(scales), "a tensor read before the capture keeps its answer"
