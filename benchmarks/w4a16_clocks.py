"""SM clock and board power while BF16 ``_grouped_mm`` and the W4A16 path run back to back (issue #21's 2048 tok/exp
forwards: is the gap to BF16 the kernel's cycles or the clock it runs at?).

A compute-bound GEMM can run at the board power limit, where the driver lowers the SM clock (measured on the H100,
2026-12-07: 696-699 W, 1290-1460 MHz); a W4A16 kernel spends extra power on its decode beside the same tensor-core work,
so it may get a lower clock than BF16 on the same GPU. Timings alone (``benchmarks/w4a16_grouped_gemm.py``) cannot tell
that apart from lost cycles, and Nsight Compute locks the clocks. Here each path of one (shape, format, tokens per
expert) runs alone for ``--seconds`` of back-to-back calls (no L2 flush, no gaps: a training step's sustained load),
BF16 and W4A16 alternating for ``--rounds`` rounds, while ``nvidia-smi`` samples the SM clock, power draw and the active
clock-event reasons every ``--sample-ms``. Per phase: ms per call (CUDA events over the whole phase), the median SM
clock and power of the samples inside it, TFLOP/s and TFLOP/s per GHz of SM clock (the work per cycle). The W4A16 row's
ratios to the same round's BF16: speed (BF16 ms / ours) and cycles (the same, each time multiplied by its clock).

    python benchmarks/w4a16_clocks.py --shapes "K3 fc1,K2 fc1" --tokens 2048 --seconds 3 --rounds 2 --out clocks.md

Prints the table; appends it to ``benchmarks/RESULTS.md`` with date, GPU, commit and command unless ``--no-append``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w4a16_grouped_gemm as bench  # noqa: E402
from w4a16_ncu_profile import FORMATS as SHORT_FORMATS  # noqa: E402 - "mxfp4" / "int4" -> the format's full name
from results import append, command, today  # noqa: E402

from kimi_core import kernels  # noqa: E402

#: nvidia-smi's name of the active clock-event (throttle) reasons bitmask, newest first (drivers renamed it)
EVENT_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"
HEADER = ("| shape | tok/exp | fmt | op | round | path | ms / call | SM MHz (median) | power W (median) "
          "| clock events | TFLOP/s | TFLOP/s per GHz | speed vs BF16 | cycles vs BF16 |")


def smi_fields() -> list[str]:
    """The ``--query-gpu`` fields to sample: time, SM clock, power and, where this driver knows one of
    :data:`EVENT_FIELDS`, the clock-event reasons."""
    help_text = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
    event = next((f for f in EVENT_FIELDS if f'"{f}"' in help_text), None)
    return ["timestamp", "clocks.sm", "power.draw"] + ([event] if event else [])


def parse_samples(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw[,<events>] --format=csv,noheader,nounits``
    -> ``{"t": datetime, "mhz": float, "watts": float, "events": str}`` (unreadable lines skipped)."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if len(cells) < 3:
            continue
        try:
            out.append({"t": datetime.datetime.strptime(cells[0], SMI_TIME), "mhz": float(cells[1]),
                        "watts": float(cells[2]), "events": cells[3] if len(cells) > 3 else ""})
        except ValueError:
            continue
    return out


def phase_stats(samples: list[dict], start: datetime.datetime, end: datetime.datetime) -> dict:
    """Median SM clock (MHz) and power (W) of the samples taken between ``start`` and ``end``, and the clock-event
    bitmasks seen there (most frequent first); NaN where no sample fell inside."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if not inside:
        return {"mhz": float("nan"), "watts": float("nan"), "events": "", "samples": 0}
    events: dict[str, int] = {}
    for s in inside:
        events[s["events"]] = events.get(s["events"], 0) + 1
    return {"mhz": statistics.median(s["mhz"] for s in inside), "watts": statistics.median(s["watts"] for s in inside),
            "events": " ".join(e for e, _ in sorted(events.items(), key=lambda kv: -kv[1]) if e),
            "samples": len(inside)}


def run_phase(fn, seconds: float) -> tuple[float, int, datetime.datetime, datetime.datetime]:
    """Calls ``fn`` back to back for about ``seconds``; ``(GPU ms per call, calls, wall start, wall end)``, the calls
    sized from one timed call so that the phase is one stream of work between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    calls = max(1, int(seconds * 1e3 / max(a.elapsed_time(b), 1e-3)))
    start = datetime.datetime.now()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls, calls, start, datetime.datetime.now()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="K3 fc1", help="comma-separated benchmark shape names (w4a16_grouped_gemm)")
    ap.add_argument("--formats", default="mxfp4,int4", help="mxfp4 and / or int4")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    ap.add_argument("--ops", default="fwd", help="fwd and / or dgrad")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of back-to-back calls per phase")
    ap.add_argument("--rounds", type=int, default=2, help="BF16 / W4A16 alternations per row")
    ap.add_argument("--sample-ms", type=int, default=50, help="nvidia-smi sampling period")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    for flag, given, known in (("--formats", args.formats, SHORT_FORMATS), ("--ops", args.ops, ("fwd", "dgrad"))):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            raise SystemExit(f"{flag}: unknown {unknown}; known: {list(known)}")
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("w4a16_clocks.py samples the SM clock and power with nvidia-smi, which is not on PATH")
    sample_file = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nothing blocks nvidia-smi
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(smi_fields())}", "--format=csv,noheader,nounits",
                            "-lms", str(args.sample_ms)], stdout=sample_file, stderr=subprocess.DEVNULL, text=True)
    phases = []
    try:
        torch.manual_seed(0)
        for name, E, K, N in bench.pick_shapes(args.shapes):
            for short in args.formats.split(","):
                fmt = SHORT_FORMATS[short]
                wp, ws = bench.random_weights(fmt, E, N, K)
                w_bf16 = bench.bf16_layer(fmt, wp, ws)
                T, splits = E * args.tokens, [args.tokens] * E
                offs = torch.arange(1, E + 1, device=bench.DEV, dtype=torch.int32) * args.tokens
                x = torch.randn(T, K, device=bench.DEV).bfloat16()
                dy = torch.randn(T, N, device=bench.DEV).bfloat16()
                baseline = bench.bf16_ops(x, dy, w_bf16, offs)
                ours = {"fwd": lambda: kernels.w4a16_grouped_gemm(x, wp, ws, fmt, splits),
                        "dgrad": lambda: kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits)}
                for op in args.ops.split(","):
                    path = kernels.choose_path(op, T, E, N, K, x.device)
                    for rnd in range(args.rounds):
                        for label, fn in (("BF16", baseline[op]), (f"W4A16 ({path})", ours[op])):
                            ms, calls, start, end = run_phase(fn, args.seconds)
                            phases.append(dict(shape=name, tokens=args.tokens, fmt=bench.fmt_name(fmt), op=op,
                                               round=rnd, path=label, ms=ms, calls=calls, start=start, end=end,
                                               tflops=2.0 * T * N * K / ms / 1e9))
                            print(f"{name} {short} {op} round {rnd} {label}: {ms:.3f} ms x {calls}", flush=True)
                del w_bf16, wp, ws, x, dy
                torch.cuda.empty_cache()
    finally:
        smi.terminate()
        smi.wait()
        sample_file.seek(0)
        samples = parse_samples(sample_file.read())
    text = table(phases, samples)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not args.no_append:
        append(f"\n## W4A16 vs BF16: SM clock and power under sustained calls\n\n- date: {today()}\n- GPU: "
               f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n- commit: {bench.commit()}\n"
               f"- command: `{command('w4a16_clocks.py')}`\n\n{text}\n")


def table(phases: list[dict], samples: list[dict]) -> str:
    """The markdown table of ``phases`` (:func:`run_phase` results with their row keys) with their clock and power
    from ``samples`` (:func:`parse_samples`); a W4A16 row's ratios are to the BF16 phase of the same row and round."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    bf16 = {}
    for p in phases:
        st = phase_stats(samples, p["start"], p["end"])
        per_ghz = p["tflops"] / (st["mhz"] / 1e3)
        key = (p["shape"], p["fmt"], p["op"], p["round"])
        ratios = "| - | - |"
        if p["path"] == "BF16":
            bf16[key] = (p["ms"], st["mhz"])
        elif key in bf16:
            ms0, mhz0 = bf16[key]
            ratios = f"| {ms0 / p['ms']:.3f}x | {ms0 * mhz0 / (p['ms'] * st['mhz']):.3f}x |"
        lines.append(f"| {p['shape']} | {p['tokens']} | {p['fmt']} | {p['op']} | {p['round']} | {p['path']} "
                     f"| {p['ms']:.3f} | {st['mhz']:.0f} | {st['watts']:.0f} | {st['events'] or '-'} "
                     f"| {p['tflops']:.0f} | {per_ghz:.0f} {ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
