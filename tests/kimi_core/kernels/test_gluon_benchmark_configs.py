"""The Gluon benchmark's config strings (``benchmarks/w4a16_grouped_gemm.py --gluon-configs``) read into the keyword
arguments of :func:`kimi_core.kernels.gluon_w4a16.grouped_gemm`, within the kernel's compiled choices."""

from __future__ import annotations

import pytest
from utils import load_benchmark


@pytest.mark.parametrize("text,want", [
    ("auto", {}),
    ("autop", {"persistent": True}),
    ("auton256p", {"persistent": True, "block_n": 256}),
    ("128x4s4", {"block_m": 128, "decode_warps": 4, "load_stages": 4}),
    ("16x8", {"block_m": 16, "decode_warps": 8, "load_stages": None}),
    ("16x4s3n256p", {"persistent": True, "block_n": 256, "block_m": 16, "decode_warps": 4, "load_stages": 3}),
    ("rs", {"kernel": "registers", "load_stages": None}),
    ("rs128s6p", {"kernel": "registers", "block_m": 128, "load_stages": 6, "persistent": True}),
    ("rsn128p", {"kernel": "registers", "load_stages": None, "block_n": 128, "persistent": True}),
    ("rs256s4n128", {"kernel": "registers", "block_m": 256, "load_stages": 4, "block_n": 128}),
    ("rsn128k4p", {"kernel": "registers", "load_stages": None, "block_n": 128, "mma_chunks": 4, "persistent": True}),
    ("rs16n128k2o2p", {"kernel": "registers", "block_m": 16, "load_stages": None, "block_n": 128, "mma_chunks": 2,
                       "ctas_per_sm": 2, "persistent": True}),
    ("rsn128ap", {"kernel": "registers", "load_stages": None, "block_n": 128, "decode_ahead": True,
                  "persistent": True}),
    ("rs64o2a", {"kernel": "registers", "block_m": 64, "load_stages": None, "ctas_per_sm": 2,
                 "decode_ahead": True}),
    ("rsn128afp", {"kernel": "registers", "load_stages": None, "block_n": 128, "decode_ahead": True,
                   "fold_scales": True, "persistent": True}),
])
def test_config_strings_read_into_kernel_arguments(text, want):
    from kimi_core.kernels import gluon_w4a16 as gw

    kw = load_benchmark("w4a16_grouped_gemm").parse_gluon_config(text)
    assert kw == want
    if kw.pop("kernel", None) == "registers":  # the register-fragment forward: its own tile choices
        import inspect

        from kimi_core.kernels import gluon_w4a16_rs as rs

        bn = kw.get("block_n", 256)
        assert bn in rs.BLOCK_N_CHOICES and kw.get("block_m", gw.BM) in rs.block_m_choices(bn)
        assert set(kw) <= set(inspect.signature(rs.grouped_gemm).parameters)
        assert kw.get("mma_chunks", 1) in rs.MMA_CHUNK_CHOICES and kw.get("ctas_per_sm", 1) in (1, 2)
    else:
        assert kw.get("block_m", gw.BM) in gw.BLOCK_M_CHOICES and kw.get("block_n", gw.BN) in gw.BLOCK_N_CHOICES


@pytest.mark.parametrize("text", ["128y4", "128x", "autoq", "128x4p2", "rs128x4"])
def test_unreadable_config_names_the_flag(text):
    with pytest.raises(ValueError, match=f"--gluon-configs: cannot read '{text}'"):
        load_benchmark("w4a16_grouped_gemm").parse_gluon_config(text)


def test_best_config_row_skips_wrong_results_and_states_the_target():
    """The summary row picks the fastest config whose result matched BF16 (a faster wrong one is not a result),
    and says whether issue #21's bar at that token count (2.5x at 8, 0.9x at 128, 0.95x above) is met."""
    bench = load_benchmark("w4a16_grouped_gemm")
    r = dict(shape="K3 fc1", tokens_per_expert=128, fmt="pack-quantized", bf16_fwd_ms=1.5, bf16_dgrad_ms=1.5, gluon=[
        dict(config="wrong", op="fwd", ms=0.5, rel_err=0.3, tflops=0),
        dict(config="rs", op="fwd", ms=1.6, rel_err=0.0, tflops=0),
        dict(config="autop", op="fwd", ms=2.0, rel_err=0.0, tflops=0),
        dict(config="failed", op="dgrad", error="RuntimeError: x")])
    line = bench.gluon_best_lines(r)
    assert line.startswith("| K3 fc1 | 128 | INT4 | 1.600 (rs) | 0.94x | 0.90x met |"), line
    assert line.endswith("| none | | |"), line
    assert [bench.target_speed(t) for t in (8, 128, 512, 2048)] == [2.5, 0.9, 0.95, 0.95]


def test_targets_summary_compares_unrounded_speeds():
    """The dispatcher table's summary counts (row, op) pairs at or above issue #21's bar without rounding: 0.948x at
    512 tokens per expert prints as 0.95x in the table but misses 0.95x."""
    bench = load_benchmark("w4a16_grouped_gemm")
    rows = [dict(shape="K3 fc1", tokens_per_expert=512, fmt="mxfp4-pack-quantized", bf16_fwd_ms=0.948,
                 auto_fwd_ms=1.0, bf16_dgrad_ms=1.0, auto_dgrad_ms=1.0),
            dict(shape="K2 fc2", tokens_per_expert=8, fmt="pack-quantized", bf16_fwd_ms=2.5, auto_fwd_ms=1.0,
                 bf16_dgrad_ms=2.0, auto_dgrad_ms=1.0)]
    text = bench.targets_summary(rows)
    assert "2 of 4 op-rows met" in text, text
    assert text.endswith("missed: K3 fc1 512 MXFP4 fwd 0.948x, K2 fc2 8 INT4 dgrad 2.000x."), text


def test_shapes_flag_picks_named_shapes_and_refuses_unknown_ones():
    """``--shapes 'K2 fc1,K2 fc2'`` keeps those rows in that order; ``--quick`` is K3 fc1; an unknown name stops the
    run naming the flag and the known shapes."""
    bench = load_benchmark("w4a16_grouped_gemm")
    assert [s[0] for s in bench.pick_shapes("K2 fc2, K2 fc1")] == ["K2 fc2", "K2 fc1"]
    assert bench.pick_shapes("K2 fc1")[0] == ("K2 fc1", 24, 7168, 4096)
    assert bench.pick_shapes(None, quick=True) == bench.SHAPES[:1]
    assert bench.pick_shapes(None) == bench.SHAPES
    with pytest.raises(SystemExit, match=r"--shapes: unknown shape\(s\) \['K9 fc1'\]; known: \['K3 fc1'"):
        bench.pick_shapes("K9 fc1")
