"""``benchmarks/w4a16_grouped_gemm.py``'s timing in turns (``timed_alternating``): every rep runs each function
once, in the given order on even reps and reversed on odd ones, and each function gets the median of its own
times. The GPU timing of one call is replaced by a recorder here (CPU only), so the test checks the order and the
medians against values written out by hand."""

from __future__ import annotations

from utils import load_benchmark


def test_timed_alternating_order_and_medians(monkeypatch):
    bench = load_benchmark("w4a16_grouped_gemm")
    monkeypatch.setattr(bench, "DEV", "cpu")  # the L2 flush buffer only
    calls = []
    gpu_ms = {"bf16": iter([5.0, 1.0, 3.0, 9.0]), "auto": iter([4.0, 2.0, 8.0, 6.0])}

    def fake_time_once(fn, flush):
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
