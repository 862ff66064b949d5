"""``benchmarks/w4a16.py``'s CPU-testable parts: timing in turns, the clock table, the Nsight Compute summary, the
Gluon config strings, the best-config and targets summaries and the shape flag (GPU work is not run here)."""

from __future__ import annotations

import datetime
import os

import pytest
from utils import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_timed_alternating_order_and_medians(monkeypatch):
    """Timing in turns (``timed_alternating``): every rep runs each function once, in the given order on even reps and
    reversed on odd ones, and each function gets the median of its own times. The GPU timing of one call is replaced
    by a recorder (CPU only), so the order and the medians are checked against values written out by hand."""
    bench = load_benchmark("w4a16")
    monkeypatch.setattr(bench, "DEV", "cpu")  # the L2 flush buffer only
    calls = []
    gpu_ms = {"bf16": iter([5.0, 1.0, 3.0, 9.0]), "auto": iter([4.0, 2.0, 8.0, 6.0])}

    def fake_time_once(fn, flush, head_start=True):
        name = fn()
        calls.append(name)
        return next(gpu_ms[name]), 0.5

    monkeypatch.setattr(bench, "_time_once", fake_time_once)
    warm = []
    fns = {"bf16": lambda: warm.append("bf16") or "bf16", "auto": lambda: warm.append("auto") or "auto"}
    out = bench.timed_alternating(fns, reps=4, warmup=2)
    assert warm[:4] == ["bf16", "bf16", "auto", "auto"]  # the warmup calls, before any timed one
    assert calls == ["bf16", "auto", "auto", "bf16", "bf16", "auto", "auto", "bf16"]
    assert out == {"bf16": (4.0, 0.5), "auto": (5.0, 0.5)}  # medians of (5, 1, 3, 9) and (4, 2, 8, 6)


def test_phase_clock_and_cycle_ratio():
    """``clocks`` reads nvidia-smi samples written here the way ``nvidia-smi --query-gpu=timestamp,clocks.sm,
    power.draw,clocks_event_reasons.active --format=csv,noheader,nounits`` prints them: each phase gets the median
    clock and power of the samples inside it, and a W4A16 row's cycle ratio multiplies each time by its own clock
    (numbers worked out by hand below)."""
    clocks = load_benchmark("w4a16")
    text = "\n".join(
        [
            "2026/12/07 08:00:00.100, 1800, 690.00, 0x0000000000000004",  # BF16 phase: 08:00:00 - 08:00:01
            "2026/12/07 08:00:00.600, 1810, 700.00, 0x0000000000000004",
            "2026/12/07 08:00:00.900, 1790, 695.00, 0x0000000000000000",
            "not a sample",
            "2026/12/07 08:00:01.200, 1700, 699.00, 0x0000000000000004",  # W4A16 phase: 08:00:01 - 08:00:02
            "2026/12/07 08:00:01.700, 1700, 701.00, 0x0000000000000004",
            "2026/12/07 08:00:03.000, 1980, 100.00, 0x0000000000000001",
        ]
    )  # after both phases: in neither
    samples = clocks.parse_samples(text)
    assert len(samples) == 6
    t0 = datetime.datetime(2026, 12, 7, 8, 0, 0)
    second = datetime.timedelta(seconds=1)
    row = dict(shape="K3 fc1", tokens=2048, fmt="MXFP4", op="fwd", round=0)
    phases = [
        dict(row, path="BF16", ms=13.3, start=t0, end=t0 + second, tflops=760.0),
        dict(row, path="W4A16 (gluon)", ms=14.3, start=t0 + second, end=t0 + 2 * second, tflops=707.0),
    ]
    lines = clocks.clocks_table(phases, samples).splitlines()
    assert len(lines) == 4
    bf16 = [c.strip() for c in lines[2].strip("|").split("|")]
    ours = [c.strip() for c in lines[3].strip("|").split("|")]
    assert bf16[7:10] == ["1800", "695", "0x0000000000000004 0x0000000000000000"]
    assert bf16[11] == "422" and bf16[12:] == ["-", "-"]  # 760 TFLOP/s at 1.8 GHz
    assert ours[7:10] == ["1700", "700", "0x0000000000000004"]
    # speed 13.3 / 14.3 = 0.930; cycles (13.3 ms x 1800 MHz) / (14.3 ms x 1700 MHz) = 0.985
    assert ours[11] == "416" and ours[12:] == ["0.930x", "0.985x"]
    empty = clocks.phase_stats(samples, t0 - 2 * second, t0 - second)
    assert empty["samples"] == 0 and empty["mhz"] != empty["mhz"]  # NaN where no sample fell inside


HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _row(kid, kernel, metric, unit, value):
    return (
        f'"{kid}","7","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","S","{metric}",'
        f'"{unit}","{value}"'
    )


def test_summary_rows(tmp_path):
    """``profile summarize`` of an Nsight Compute CSV (``--csv --page details``) written here the way ncu writes it:
    units converted, one row per kernel, stall reasons ranked, a file with no kernel said so."""
    lines = [
        "==PROF== Connected to process 7",
        HEAD,
        _row(0, "w4a16_rs_kernel", "Duration", "us", "17,330.50"),
        _row(0, "w4a16_rs_kernel", "Compute (SM) Throughput", "%", "61.2"),
        _row(0, "w4a16_rs_kernel", "Issue Slots Busy", "%", "48.5"),
        _row(0, "w4a16_rs_kernel", "Stall Wait", "", "1.5"),
        _row(0, "w4a16_rs_kernel", "Stall Long Scoreboard", "", "4.25"),
        _row(0, "w4a16_rs_kernel", "Stall Barrier", "", "0.5"),
        _row(0, "w4a16_rs_kernel", "Stall Math Pipe Throttle", "", "2.0"),
        _row(1, "cutlass_grouped_gemm", "Duration", "ms", "13.9"),
        _row(1, "cutlass_grouped_gemm", "Block Limit Registers", "block", "n/a"),
    ]
    path = tmp_path / "k3_fc1.csv"
    path.write_text("\n".join(lines) + "\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== No kernels were profiled.\n")
    table = load_benchmark("w4a16").summarize([str(path), str(empty)]).splitlines()
    assert len(table) == 5, table
    ours = table[2].split(" | ")
    assert ours[1] == "0 w4a16_rs_kernel" and ours[2] == "17.3" and ours[3] == "61.2" and ours[6] == "48.5"
    assert ours[-1].rstrip(" |") == "Long Scoreboard 4.2, Math Pipe Throttle 2, Wait 1.5"
    assert table[3].split(" | ")[2] == "13.9"  # ms stays ms
    assert "no kernel profiled" in table[4]


def test_tensor_pipe_column_and_metric_name(tmp_path):
    """The tensor pipe's busy share (asked for with ``--metrics``) lands in its column whatever base name this ncu
    lists, and ``tensor-metric`` picks the first listed base of ``TENSOR_PIPE_BASES`` out of ``--query-metrics``."""
    import subprocess
    import sys

    module = load_benchmark("w4a16")
    path = tmp_path / "k3_fc1_gluon.csv"
    path.write_text(
        "\n".join(
            [
                HEAD,
                _row(0, "w4a16_rs_kernel", "Duration", "ms", "15.2"),
                _row(
                    0,
                    "w4a16_rs_kernel",
                    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                    "%",
                    "81.25",
                ),
            ]
        )
        + "\n"
    )
    table = module.summarize([str(path)]).splitlines()
    column = table[0].split(" | ").index("tensor pipe active %")
    assert table[2].split(" | ")[column] == "81.2"
    script = os.path.join(ROOT, "benchmarks", "w4a16.py")
    listing = (
        "Device GH100 (sm_90)\n----\nsm__pipe_tensor_op_hmma_cycles_active   Counter   # of cycles\n"
        "sm__pipe_tensor_op_gmma_cycles_active   Counter   # of cycles\n"
    )
    picked = subprocess.run(
        [sys.executable, script, "profile", "tensor-metric"], input=listing, capture_output=True, text=True
    )
    assert picked.stdout.strip() == "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
    none = subprocess.run(
        [sys.executable, script, "profile", "tensor-metric"], input="nothing\n", capture_output=True, text=True
    )
    assert none.returncode == 0 and none.stdout.strip() == ""


@pytest.mark.parametrize(
    "text,want",
    [
        ("rs", {"load_stages": None}),
        ("rs128s6p", {"block_m": 128, "load_stages": 6, "persistent": True}),
        ("rsn128p", {"load_stages": None, "block_n": 128, "persistent": True}),
        ("rs256s4n128", {"block_m": 256, "load_stages": 4, "block_n": 128}),
        ("rsn128ap", {"load_stages": None, "block_n": 128, "decode_ahead": True, "persistent": True}),
        (
            "rsn128afp",
            {"load_stages": None, "block_n": 128, "decode_ahead": True, "fold_scales": True, "persistent": True},
        ),
    ],
)
def test_gluon_config_strings_read_into_kernel_arguments(text, want):
    """``gluon --configs`` strings read into keyword arguments of the Gluon register kernels, within its compiled
    tile choices; ``auto`` is what the dispatcher's ``"gluon"`` path passes."""
    import inspect

    from kimi_core.kernels import GLUON_OPTIONS
    from kimi_core.kernels.w4a16 import gluon
    from kimi_core.kernels.w4a16.gluon import tiles

    bench = load_benchmark("w4a16")
    kw = bench.parse_gluon_config(text)
    assert kw == want
    bn = kw.get("block_n", 256)
    assert bn in tiles.BLOCK_N_CHOICES and kw.get("block_m", tiles.BM) in tiles.block_m_choices(bn)
    assert set(kw) <= set(inspect.signature(gluon.grouped_gemm).parameters)
    assert set(kw) <= set(inspect.signature(gluon.grouped_gemm_dgrad).parameters)
    assert bench.parse_gluon_config("auto") == GLUON_OPTIONS["fwd"]


@pytest.mark.parametrize("text", ["128y4", "rs128x4", "autoq", "rsk4", "rso2", "128x4s4"])
def test_unreadable_gluon_config_names_the_flag(text):
    """A config string outside the grammar (or naming an option the kernels no longer have) names the flag."""
    with pytest.raises(ValueError, match=f"gluon --configs: cannot read '{text}'"):
        load_benchmark("w4a16").parse_gluon_config(text)


def test_best_config_row_skips_wrong_results_and_states_the_target():
    """The summary row picks the fastest config whose result matched BF16 (a faster wrong one is not a result),
    and says whether the project's bar at that token count (2.5x at 8, 0.9x at 128, 0.95x above) is met."""
    bench = load_benchmark("w4a16")
    r = dict(
        shape="K3 fc1",
        tokens_per_expert=128,
        fmt="pack-quantized",
        bf16_fwd_ms=1.5,
        bf16_dgrad_ms=1.5,
        gluon=[
            dict(config="wrong", op="fwd", ms=0.5, rel_err=0.3, tflops=0),
            dict(config="rs", op="fwd", ms=1.6, rel_err=0.0, tflops=0),
            dict(config="autop", op="fwd", ms=2.0, rel_err=0.0, tflops=0),
            dict(config="failed", op="dgrad", error="RuntimeError: x"),
        ],
    )
    line = bench.gluon_best_line(r)
    assert line.startswith("| K3 fc1 | 128 | INT4 | 1.600 (rs) | 0.94x | 0.90x met |"), line
    assert line.endswith("| none | | |"), line
    assert [bench.target_speed(t) for t in (8, 128, 512, 2048)] == [2.5, 0.9, 0.95, 0.95]


def test_targets_summary_compares_unrounded_speeds():
    """The dispatcher table's summary counts (row, op) pairs at or above the project's bar without rounding: 0.948x at
    512 tokens per expert prints as 0.95x in the table but misses 0.95x."""
    bench = load_benchmark("w4a16")
    rows = [
        dict(
            shape="K3 fc1",
            tokens_per_expert=512,
            fmt="mxfp4-pack-quantized",
            bf16_fwd_ms=0.948,
            auto_fwd_ms=1.0,
            bf16_dgrad_ms=1.0,
            auto_dgrad_ms=1.0,
        ),
        dict(
            shape="K2 fc2",
            tokens_per_expert=8,
            fmt="pack-quantized",
            bf16_fwd_ms=2.5,
            auto_fwd_ms=1.0,
            bf16_dgrad_ms=2.0,
            auto_dgrad_ms=1.0,
        ),
    ]
    text = bench.targets_summary(rows)
    assert "2 of 4 op-rows met" in text, text
    assert text.endswith("missed: K3 fc1 512 MXFP4 fwd 0.948x, K2 fc2 8 INT4 dgrad 2.000x."), text


def test_shapes_flag_picks_named_shapes_and_refuses_unknown_ones():
    """``--shapes 'K2 fc1,K2 fc2'`` keeps those rows in that order; ``--quick`` is K3 fc1; an unknown name stops the
    run naming the flag and the known shapes."""
    bench = load_benchmark("w4a16")
    assert [s[0] for s in bench.pick_shapes("K2 fc2, K2 fc1")] == ["K2 fc2", "K2 fc1"]
    assert bench.pick_shapes("K2 fc1")[0] == ("K2 fc1", 24, 7168, 4096)
    assert bench.pick_shapes(None, quick=True) == bench.SHAPES[:1]
    assert bench.pick_shapes(None) == bench.SHAPES
    with pytest.raises(SystemExit, match=r"--shapes: unknown shape\(s\) \['K9 fc1'\]; known: \['K3 fc1'"):
        bench.pick_shapes("K9 fc1")


def test_launch_token_splits_and_shapes():
    """``launch``'s tokens per expert sum to ``E x tokens``: uniform all equal; Zipf-skewed with the largest expert
    near ``1 / H_E`` of the tokens (``H_E`` the harmonic number, exponent 1) and every expert's share within one token
    of ``T / (r H_E)``; its ``--shapes`` picks the Kimi expert shapes by any of their names."""
    bench = load_benchmark("w4a16")
    assert bench.token_splits(4, 8, "uniform") == [8] * 4
    E, tpe = 112, 512
    z = bench.token_splits(E, tpe, "zipf", seed=1)
    T = E * tpe
    harmonic = sum(1 / r for r in range(1, E + 1))
    assert sum(z) == T and len(z) == E
    for r, m in enumerate(sorted(z, reverse=True), start=1):
        assert abs(m - T / (r * harmonic)) <= 1, (r, m)
    picked = bench.pick_launch_shapes("K3 fc2 etp8")
    assert [(N, K) for N, K, _, _ in picked] == [(3584, 384)]
    assert len(bench.pick_launch_shapes(None)) == 18
    with pytest.raises(SystemExit, match="no Kimi expert shape matches"):
        bench.pick_launch_shapes("K9")


def test_launch_rows_on_the_cpu(monkeypatch):
    """``launch``'s row of one small shape, run on the CPU (the naive twin; GPU timing replaced by fixed numbers):
    forward and dgrad rows with the dispatcher's path, an error against BF16 well under the warning bound, both
    timing modes, the speed as BF16 ms over ours, and a table line and summary that name what misses the bars."""
    bench = load_benchmark("w4a16")
    monkeypatch.setattr(bench, "DEV", "cpu")
    times = {True: {"bf16": (1.0, 0.01), "w4a16": (0.5, 0.2)}, False: {"bf16": (2.0, 0.01), "w4a16": (4.0, 0.03)}}
    monkeypatch.setattr(bench, "timed_alternating", lambda fns, reps, head_start: times[head_start])
    monkeypatch.setattr(
        bench, "new_pattern_host_ms", lambda call, splits, form: (call(bench.splits_as(splits, form)), 0.3)[1]
    )
    fmt = bench.SHORT_FORMATS["mxfp4"]
    E, N, K = 3, 64, 128
    wp, ws = bench.random_weights(fmt, E, N, K)
    w_bf16 = bench.bf16_layer(fmt, wp, ws)
    rows = bench.measure_launch(["TINY fc1 etp1"], E, K, N, fmt, wp, ws, w_bf16, 8, "zipf", "cpu", reps=3)
    assert [r["op"] for r in rows] == ["fwd", "dgrad"] and all(r["path"] == "fused" for r in rows)
    for r in rows:
        assert r["rel_err"] < 1e-2 and r["tokens"] == 24
        assert r["speed_kernels"] == 2.0 and r["speed_launch"] == 0.5
        assert r["w4a16_launch_host_ms"] == 0.03 and r["w4a16_host_ms_new_pattern"] == 0.3
        line = bench.format_launch_row(r)
        assert line.count("|") == bench.LAUNCH_HEADER.count("|") and "| 0.50x |" in line
    summary = bench.launch_summary(rows)
    assert "2 rows missed" in summary and "TINY fc1 etp1 MXFP4 8 zipf fwd 0.50x" in summary
    assert "Host time per call over 50 us: 0 rows" in summary
