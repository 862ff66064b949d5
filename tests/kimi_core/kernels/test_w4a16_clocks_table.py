"""benchmarks/w4a16_clocks.py's reading of nvidia-smi samples and its table, on samples written here the way
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,nounits``
prints them: each phase gets the median clock and power of the samples inside it, and a W4A16 row's cycle ratio
multiplies each time by its own clock (numbers worked out by hand below)."""

from __future__ import annotations

import datetime

from utils import load_benchmark


def _clocks_module():
    return load_benchmark("w4a16_clocks")


def test_phase_clock_and_cycle_ratio():
    clocks = _clocks_module()
    text = "\n".join([
        "2026/12/07 08:00:00.100, 1800, 690.00, 0x0000000000000004",  # BF16 phase: 08:00:00 - 08:00:01
        "2026/12/07 08:00:00.600, 1810, 700.00, 0x0000000000000004",
        "2026/12/07 08:00:00.900, 1790, 695.00, 0x0000000000000000",
        "not a sample",
        "2026/12/07 08:00:01.200, 1700, 699.00, 0x0000000000000004",  # W4A16 phase: 08:00:01 - 08:00:02
        "2026/12/07 08:00:01.700, 1700, 701.00, 0x0000000000000004",
        "2026/12/07 08:00:03.000, 1980, 100.00, 0x0000000000000001"])  # after both phases: in neither
    samples = clocks.parse_samples(text)
    assert len(samples) == 6
    t0 = datetime.datetime(2026, 12, 7, 8, 0, 0)
    second = datetime.timedelta(seconds=1)
    row = dict(shape="K3 fc1", tokens=2048, fmt="MXFP4", op="fwd", round=0)
    phases = [dict(row, path="BF16", ms=13.3, start=t0, end=t0 + second, tflops=760.0),
              dict(row, path="W4A16 (gluon)", ms=14.3, start=t0 + second, end=t0 + 2 * second, tflops=707.0)]
    lines = clocks.table(phases, samples).splitlines()
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
