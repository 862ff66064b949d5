"""Benchmark of the W4A16 grouped GEMM paths (forward and dgrad) on MXFP4 and INT4 experts against BF16.

One run times, for each Kimi expert shape and tokens per expert: BF16 ``torch._grouped_mm`` on bf16 copies of
the same weights, the fused Triton kernels (``kimi_core.kernels.triton_w4a16``), the chunked dequantize-then-
``_grouped_mm`` path (``kimi_core.kernels.w4a16_chunked``, with its bf16 workspace and the peak memory it adds)
and the path the dispatcher (``kimi_core.kernels.choose_path``) picks, forward and dgrad. Speeds are BF16 time /
our time (1.00x = BF16 speed, higher is faster). A second table gives the decode kernel's bandwidth per shape.
The tables are printed, appended to ``benchmarks/RESULTS.md`` with date, GPU, torch, commit and command, and
with ``--json PATH`` written as JSON as well. About two minutes on one H200.

Usage: ``python benchmarks/w4a16_grouped_gemm.py [--json rows.json] [--out rows.md] [--no-append] [--quick]
[--tokens 8,128,512,2048] [--workspace-mib 1024] [--sweep]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import append, git_commit  # noqa: E402

from kimi_core import kernels  # noqa: E402
from kimi_core.kernels import triton_w4a16 as tw  # noqa: E402
from kimi_core.kernels import w4a16_chunked as wc  # noqa: E402
from kimi_core.quant import dequantize  # noqa: E402

SHAPES = [("K3 fc1", 112, 3584, 6144), ("K3 fc2", 112, 3072, 3584), ("K2 fc1", 24, 7168, 4096),
          ("K2 fc2", 24, 2048, 7168)]
TOKENS = [8, 128, 512, 2048]
FORMATS = ["mxfp4-pack-quantized", "pack-quantized"]
HBM = 4.2e12  # issue #21's reachable HBM bandwidth on the H200 (87.5 % of its 4.8 TB/s)
HBM_BY_GPU = {"H100": 3.35e12 * 0.875, "H200": HBM}  # the same share of each card's HBM
MMA = 700e12  # reachable dense BF16 MMA, both cards (cuBLAS-class kernels measure 690-720 TFLOP/s on either)
REPS = 20
DEV = "cuda"
# the GPU spins this long before each timed call (timed): a head start for the host's launches
HEAD_START_MS = 2.0
HEAD_START_CYCLES = int(HEAD_START_MS * 2.0e6)  # at ~2 GHz SM clock (H100 1.98, H200 1.98 GHz boost)


def timed(fn, reps: int = REPS, warmup: int = 3) -> tuple[float, float]:
    """(median GPU ms, median host ms) of ``fn`` over ``reps`` runs, L2 flushed before each: GPU time between CUDA
    events around the call, host time of the call itself (Python, argument checks, launches; a hidden device sync
    makes it the GPU time). After the flush the GPU spins for :data:`HEAD_START_MS` (``torch.cuda._sleep``) before
    the first event, so the host has queued the whole call by the time the GPU reaches it and the GPU time is the
    kernels' alone, as in a training step where the host runs ahead of the GPU; a host time above the head start
    says the GPU would wait for this call's launches there too."""
    return timed_alternating({"fn": fn}, reps, warmup)["fn"]


def _time_once(fn, flush: torch.Tensor) -> tuple[float, float]:
    """(GPU ms, host ms) of one call of ``fn`` after flushing L2 (``flush``: a 256 MiB int32 buffer) and giving the
    GPU the :data:`HEAD_START_MS` head start (:func:`timed`)."""
    flush.zero_()
    torch.cuda._sleep(HEAD_START_CYCLES)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    b.record()
    b.synchronize()
    return a.elapsed_time(b), host_ms


def timed_alternating(fns: dict, reps: int = REPS, warmup: int = 3) -> dict:
    """``{name: (median GPU ms, median host ms)}`` of each of ``fns`` timed as :func:`timed` does, but in turns:
    each rep runs every function once (L2 flushed and the head start before each), in the given order on even reps
    and reversed on odd ones. A speed ratio of two kernels at the board's power cap depends on what the card ran
    just before (its SM clock follows the power drawn over the last milliseconds: benchmarks/w4a16_clocks.py);
    timed in turns, both see the same recent load, where timed one after the other the second inherits the
    first's."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=DEV)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: ([], []) for name in fns}
    order = list(fns)
    for rep in range(reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            gpu_ms, host_ms = _time_once(fns[name], flush)
            times[name][0].append(gpu_ms)
            times[name][1].append(host_ms)
    return {name: (statistics.median(gpu), statistics.median(host)) for name, (gpu, host) in times.items()}


def bench(fn, reps: int = REPS, warmup: int = 3) -> float:
    """Median GPU ms of ``fn`` (:func:`timed`)."""
    return timed(fn, reps, warmup)[0]


def peak_extra(fn) -> float:
    """GiB allocated by one call of ``fn`` at its peak, above what was allocated before it (output included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def random_weights(fmt, E, N, K):
    if fmt == "mxfp4-pack-quantized":
        wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=DEV)
        ws = torch.randint(118, 125, (E, N, K // 32), dtype=torch.uint8, device=DEV)
    else:
        wp = torch.randint(-(2**31), 2**31 - 1, (E, N, K // 8), dtype=torch.int64, device=DEV).to(torch.int32)
        ws = (torch.rand((E, N, K // 32), device=DEV) * 0.02 + 0.002).to(torch.bfloat16)
    return wp, ws


def bf16_layer(fmt, wp, ws, out: torch.Tensor | None = None) -> torch.Tensor:
    """The BF16 baseline's experts: ``wp`` / ``ws`` dequantized one expert at a time (no layer-sized temporaries)
    into ``out`` (bf16 ``[E, N, K]``, allocated when None)."""
    E, N, K = wp.shape[0], wp.shape[1], ws.shape[2] * 32
    out = torch.empty((E, N, K), dtype=torch.bfloat16, device=DEV) if out is None else out
    for e in range(E):
        out[e] = dequantize(fmt, wp[e], ws[e], torch.bfloat16)
    return out


def bf16_ops(x, dy, w_bf16, offs) -> dict:
    """BF16 ``_grouped_mm`` forward (``x . W^T``) and dgrad (``dy . W``) over ``w_bf16`` ``[E, N, K]`` with expert end
    rows ``offs``: the baseline every W4A16 timing is divided by."""
    return {"fwd": lambda: torch._grouped_mm(x, w_bf16.transpose(1, 2), offs=offs, out_dtype=torch.bfloat16),
            "dgrad": lambda: torch._grouped_mm(dy, w_bf16, offs=offs, out_dtype=torch.bfloat16)}


def fmt_name(fmt: str) -> str:
    return "MXFP4" if fmt.startswith("mxfp4") else "INT4"


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def commit() -> str:
    return git_commit((":/kimi_core/kernels", ":/benchmarks/w4a16_grouped_gemm.py"), "kernel", default="uncommitted")


HEADER = ("| shape | E | K | N | tok/exp | fmt | BF16 fwd ms | fused fwd ms | chunked fwd ms | workspace GiB (chunks) "
          "| chunked peak extra GiB | auto fwd | auto fwd speed vs BF16 | auto fwd TFLOP/s | auto fwd TB/s "
          "| auto fwd % roofline | BF16 dgrad ms | fused dgrad ms | chunked dgrad ms | auto dgrad "
          "| auto dgrad speed vs BF16 | auto dgrad TFLOP/s | auto dgrad TB/s | auto dgrad % roofline "
          "| auto host ms fwd / dgrad |")
DECODE_HEADER = "| shape | fmt | experts decoded | decode ms | read GB | written GB | decode TB/s |"
GLUON_HEADER = ("| shape | tok/exp | fmt | op | config (block_m x decode warps [s load stages] [n block_n] "
                "[p persistent]) | BF16 ms | gluon ms | speed vs BF16 | TFLOP/s | rel err vs BF16 | host ms |")


def parse_gluon_config(text: str) -> dict:
    """``auto`` (the kernel's own tile rows) or ``<block_m>x<decode_warps>[s<load_stages>]``, either followed by
    ``n<block_n>`` (output columns per tile, 128 or 256) and ``p`` (the persistent schedule: one program per SM),
    e.g. ``64x4``, ``128x4s4``, ``autop``, ``auton256p`` -> keyword arguments of ``gluon_w4a16``; or
    ``rs[<block_m>][s<load_stages>][n<block_n>][k<mma_chunks>][o<ctas_per_sm>][a][f][p]`` (e.g. ``rs``, ``rsp``,
    ``rs128s6p``, ``rsn128p``, ``rsn128k4p``, ``rs16n128k4o2p``, ``rsn128ap``): the forward with the weights in the
    wgmma's registers (``gluon_w4a16_rs``, its own column pick ``pick_block_n`` unless ``n<block_n>``; ``k``: wgmmas
    per K step; ``o2``: two programs per SM; ``a``: decode ahead, the next step decoded while a wgmma runs; ``f``: MXFP4
    scales folded, one multiply per decoded pair), with ``kernel="registers"`` among the arguments. The result
    is what :data:`kimi_core.kernels.GLUON_OPTIONS` holds (``kernel`` ``"smem"`` when absent)."""
    m = re.fullmatch(r"rs(\d+)?(?:s(\d+))?(?:n(\d+))?(?:k(\d))?(?:o(\d))?(a?)(f?)(p?)", text)
    if m:
        bm, stages, bn, chunks, ctas, ahead, fold, persistent = m.groups()
        kw = {"kernel": "registers", "load_stages": int(stages) if stages else None}
        if ahead:
            kw["decode_ahead"] = True
        if fold:
            kw["fold_scales"] = True
        for key, value in (("block_m", bm), ("block_n", bn), ("mma_chunks", chunks), ("ctas_per_sm", ctas)):
            if value:
                kw[key] = int(value)
        return dict(kw, persistent=True) if persistent else kw
    m = re.fullmatch(r"(auto|(\d+)x(\d+)(?:s(\d+))?)(?:n(\d+))?(p?)", text)
    if not m:
        raise ValueError(f"--gluon-configs: cannot read {text!r} (auto or <block_m>x<decode_warps>[s<load_stages>], "
                         f"then [n<block_n>][p]; or rs[<block_m>][s<load_stages>][n<block_n>][k<mma_chunks>][o<ctas_per_sm>][a][f][p])")
    _, bm, warps, stages, bn, persistent = m.groups()
    kw = {"persistent": True} if persistent else {}
    if bn:
        kw["block_n"] = int(bn)
    if bm:
        kw.update(block_m=int(bm), decode_warps=int(warps), load_stages=int(stages) if stages else None)
    return kw


def hbm_bytes_per_s() -> float:
    """The roofline's bandwidth on this GPU: :data:`HBM_BY_GPU` by name, else the H200's."""
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BY_GPU.items() if key in name), HBM)


def measure(name, E, K, N, fmt, wp, ws, w_bf16, tpe, alt_bytes: int | None = None, gluon: list[str] | None = None,
            gluon_only: bool = False) -> dict:
    """All timings of one (shape, format, tokens per expert) row; ``alt_bytes``: also time chunked at that bound;
    ``gluon``: also the experimental warp-specialised forward and dgrad (``kimi_core.kernels.gluon_w4a16``, #21) in
    each of these configs (:func:`parse_gluon_config`); ``gluon_only``: BF16 and those alone."""
    T = E * tpe
    splits = [tpe] * E
    offs = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * tpe
    x = torch.randn(T, K, device=DEV).bfloat16()
    dy = torch.randn(T, N, device=DEV).bfloat16()
    bf16 = bf16_ops(x, dy, w_bf16, offs)
    fns = {
        "bf16_fwd": bf16["fwd"],
        "fused_fwd": lambda: tw.grouped_gemm(x, wp, ws, fmt, splits, **kernels.FUSED_OPTIONS["fwd"]),
        "chunked_fwd": lambda: wc.grouped_gemm(x, wp, ws, fmt, splits),
        "bf16_dgrad": bf16["dgrad"],
        "fused_dgrad": lambda: tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, **kernels.FUSED_OPTIONS["dgrad"]),
        "chunked_dgrad": lambda: wc.grouped_gemm_dgrad(dy, wp, ws, fmt, splits),
    }
    row = dict(shape=name, E=E, K=K, N=N, tokens_per_expert=tpe, fmt=fmt)
    flops = 2.0 * T * N * K
    if gluon_only:
        for op in ("fwd", "dgrad"):
            row[f"bf16_{op}_ms"] = bench(fns[f"bf16_{op}"])
        row["gluon"] = measure_gluon(fns, x, dy, wp, ws, fmt, splits, flops, gluon)
        return row
    for op in ("fwd", "dgrad"):  # correctness against BF16 on the same weights, then memory, then time
        ref = fns[f"bf16_{op}"]()
        row[f"fused_{op}_rel_err"] = rel_err(ref, fns[f"fused_{op}"]())
        row[f"chunked_{op}_rel_err"] = rel_err(ref, fns[f"chunked_{op}"]())
        del ref
        row[f"chunked_{op}_peak_extra_gib"] = peak_extra(fns[f"chunked_{op}"])
        plan = wc.plan_chunks(E, N, K, op)
        row[f"chunked_{op}_workspace_gib"] = plan.workspace_bytes / 2**30
        row[f"chunked_{op}_chunks"] = plan.num_chunks
        for path in ("fused", "chunked"):
            row[f"{path}_{op}_ms"], row[f"{path}_{op}_host_ms"] = timed(fns[f"{path}_{op}"])
        auto = kernels.choose_path(op, T, E, N, K, x.device)
        row[f"auto_{op}"] = auto
        auto_fn = fns.get(f"{auto}_{op}")
        if auto == "gluon":  # the dispatcher's Gluon kernel (GLUON_OPTIONS), checked and timed as the others
            auto_fn = (lambda: kernels.w4a16_grouped_gemm(x, wp, ws, fmt, splits, path="gluon")) if op == "fwd" \
                else (lambda: kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits, path="gluon"))
            row[f"gluon_{op}_rel_err"] = rel_err(fns[f"bf16_{op}"](), auto_fn())
        # BF16 and the path the dispatcher calls, timed in turns (the speed ratio of the table)
        paired = timed_alternating({"bf16": fns[f"bf16_{op}"], "auto": auto_fn})
        row[f"bf16_{op}_ms"], row[f"bf16_{op}_host_ms"] = paired["bf16"]
        row[f"auto_{op}_ms"], row[f"auto_{op}_host_ms"] = paired["auto"]
        if auto == "gluon":
            row[f"gluon_{op}_ms"], row[f"gluon_{op}_host_ms"] = paired["auto"]
        row[f"auto_{op}_speed_vs_bf16"] = row[f"bf16_{op}_ms"] / row[f"auto_{op}_ms"]
        worst = max(row[f"fused_{op}_rel_err"], row[f"chunked_{op}_rel_err"], row.get(f"gluon_{op}_rel_err", 0.0))
        if worst > 1e-2:
            print(f"WARNING {name} {fmt} tpe={tpe} {op}: relative error vs BF16 {worst:.2e}", flush=True)
    moved = wp.numel() * wp.element_size() + ws.numel() * ws.element_size() + 2 * T * (K + N)  # bytes, either op
    roof_ms = max(moved / hbm_bytes_per_s(), flops / MMA) * 1e3
    for op in ("fwd", "dgrad"):  # the achieved rates that say which roof a row is under
        row[f"auto_{op}_tflops"] = flops / row[f"auto_{op}_ms"] / 1e9
        row[f"auto_{op}_tb_per_s"] = moved / row[f"auto_{op}_ms"] / 1e9
        row[f"auto_{op}_roofline_pct"] = 100 * roof_ms / row[f"auto_{op}_ms"]
    if alt_bytes:
        row["alt_fwd_ms"] = bench(lambda: wc.grouped_gemm(x, wp, ws, fmt, splits, workspace_bytes=alt_bytes))
        row["alt_dgrad_ms"] = bench(lambda: wc.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, workspace_bytes=alt_bytes))
        row["alt_fwd_chunks"] = wc.plan_chunks(E, N, K, "fwd", alt_bytes).num_chunks
    if gluon:
        row["gluon"] = measure_gluon(fns, x, dy, wp, ws, fmt, splits, flops, gluon)
    return row


def measure_gluon(fns, x, dy, wp, ws, fmt, splits, flops, configs: list[str]) -> list[dict]:
    """The experimental Gluon forward and dgrad in each config: one dict per (config, op) with ms, TFLOP/s and the
    relative error against BF16 on the same weights, or the error that stopped it."""
    from kimi_core.kernels import gluon_w4a16 as gw

    out = []
    for config in configs:
        kw = parse_gluon_config(config)
        gluon_fns = {"fwd": lambda: kernels.run_gluon("fwd", x, wp, ws, fmt, splits, kw)}
        # the register-fragment dgrad runs neither K slices nor two programs per SM
        if not (kw.get("kernel") == "registers" and ({"mma_chunks", "ctas_per_sm"} & kw.keys())):
            gluon_fns["dgrad"] = lambda: kernels.run_gluon("dgrad", dy, wp, ws, fmt, splits, kw)
        for op, fn in gluon_fns.items():
            label = config
            if config.startswith("rs") and "block_m" not in kw:
                from kimi_core.kernels import gluon_w4a16_rs as rs

                bn = kw.get("block_n") or rs.pick_block_n(splits)
                label = f"{config} ({rs.pick_block_m(splits, bn)} rows x {bn} cols)"
            elif config.startswith("auto"):
                label = f"{config} ({gw.pick_block_m(splits)}x{gw.DECODE_WARPS})"
            r = dict(config=label, op=op)
            try:  # experimental: a failure is a row of the table, not the end of the benchmark
                ref = fns[f"bf16_{op}"]()
                r["rel_err"] = rel_err(ref, fn())
                del ref
                r["ms"], r["host_ms"] = timed(fn)
                r["tflops"] = flops / r["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 - recorded in the table
                r["error"] = f"{type(e).__name__}: {e}"[:200]
            out.append(r)
    return out


def format_row(r: dict) -> str:
    short = fmt_name(r["fmt"])
    return (f"| {r['shape']} | {r['E']} | {r['K']} | {r['N']} | {r['tokens_per_expert']} | {short} "
            f"| {r['bf16_fwd_ms']:.3f} | {r['fused_fwd_ms']:.3f} | {r['chunked_fwd_ms']:.3f} "
            f"| {r['chunked_fwd_workspace_gib']:.2f} ({r['chunked_fwd_chunks']}) "
            f"| {r['chunked_fwd_peak_extra_gib']:.2f} "
            f"| {r['auto_fwd']} | {r['auto_fwd_speed_vs_bf16']:.2f}x | {r['auto_fwd_tflops']:.0f} "
            f"| {r['auto_fwd_tb_per_s']:.2f} | {r['auto_fwd_roofline_pct']:.0f}% | {r['bf16_dgrad_ms']:.3f} "
            f"| {r['fused_dgrad_ms']:.3f} | {r['chunked_dgrad_ms']:.3f} | {r['auto_dgrad']} "
            f"| {r['auto_dgrad_speed_vs_bf16']:.2f}x | {r['auto_dgrad_tflops']:.0f} | {r['auto_dgrad_tb_per_s']:.2f} "
            f"| {r['auto_dgrad_roofline_pct']:.0f}% | {r['auto_fwd_host_ms']:.3f} / {r['auto_dgrad_host_ms']:.3f} |")


def measure_decode(name, E, K, N, fmt, wp, ws) -> dict:
    """Bandwidth of the decode kernel on one forward chunk (the experts one workspace buffer holds)."""
    from kimi_core.kernels.triton_w4a16_decode import decode_experts

    plan = wc.plan_chunks(E, N, K, "fwd")
    n = plan.per_buffer
    buf = torch.empty((n, N, K), dtype=torch.bfloat16, device=DEV)
    ms = bench(lambda: decode_experts(wp, ws, fmt, 0, n, buf))
    read = n * (wp[0].numel() * wp.element_size() + ws[0].numel() * ws.element_size())
    written = buf.numel() * 2
    return dict(shape=name, fmt=fmt, experts=n, ms=ms, read_gb=read / 1e9, written_gb=written / 1e9,
                tb_per_s=(read + written) / ms / 1e9)


def gluon_lines(r: dict) -> list[str]:
    """Markdown rows of one measurement's experimental Gluon kernels (``--gluon``); a failed run shows its error."""
    short = fmt_name(r["fmt"])
    lines = []
    for g in r.get("gluon", []):
        op = g["op"]
        lead = f"| {r['shape']} | {r['tokens_per_expert']} | {short} | {op} | {g['config']} | {r[f'bf16_{op}_ms']:.3f} "
        if "ms" in g:
            lines.append(lead + f"| {g['ms']:.3f} | {r[f'bf16_{op}_ms'] / g['ms']:.2f}x | {g['tflops']:.0f} "
                         f"| {g['rel_err']:.1e} | {g['host_ms']:.3f} |")
        else:
            lines.append(lead + f"| {g.get('error', 'not run')} | | | | |")
    return lines


BEST_HEADER = ("| shape | tok/exp | fmt | best fwd ms (config) | fwd speed vs BF16 | target | best dgrad ms (config) "
               "| dgrad speed vs BF16 | target |")


def target_speed(tokens_per_expert: int) -> float:
    """Issue #21's bar for a W4A16 GEMM's speed vs BF16 ``_grouped_mm`` at this many tokens per expert."""
    return 2.5 if tokens_per_expert <= 8 else 0.9 if tokens_per_expert <= 128 else 0.95


def targets_summary(rows: list[dict]) -> str:
    """How many (row, op) pairs of the dispatcher table meet issue #21's bar (:func:`target_speed`, compared unrounded),
    and the speed of each that does not."""
    missed, total = [], 0
    for r in rows:
        for op in ("fwd", "dgrad"):
            if f"auto_{op}_ms" not in r:
                continue
            total += 1
            speed = r[f"bf16_{op}_ms"] / r[f"auto_{op}_ms"]
            if speed < target_speed(r["tokens_per_expert"]):
                missed.append(f"{r['shape']} {r['tokens_per_expert']} {fmt_name(r['fmt'])} {op} {speed:.3f}x")
    return (f"Issue #21's targets (2.5x at 8 tok/exp, 0.9x at 128, 0.95x from 512; unrounded): {total - len(missed)} of "
            f"{total} op-rows met; missed: {', '.join(missed) if missed else 'none'}.")


def gluon_best_lines(r: dict) -> str:
    """One summary row: the fastest correct Gluon config per op of one measurement (rel err vs BF16 <= 1e-2),
    its speed vs BF16 and the issue's target at these tokens per expert."""
    short = fmt_name(r["fmt"])
    cells = []
    for op in ("fwd", "dgrad"):
        ok = [g for g in r.get("gluon", []) if g["op"] == op and "ms" in g and g["rel_err"] <= 1e-2]
        if not ok:
            cells.append("none | |")
            continue
        best = min(ok, key=lambda g: g["ms"])
        speed = r[f"bf16_{op}_ms"] / best["ms"]
        target = target_speed(r["tokens_per_expert"])
        cells.append(f"{best['ms']:.3f} ({best['config']}) | {speed:.2f}x | {target:.2f}x "
                     f"{'met' if speed >= target else 'missed'}")
    return f"| {r['shape']} | {r['tokens_per_expert']} | {short} | " + " | ".join(cells) + " |"


def gluon_table(rows: list[dict]) -> list[str]:
    """The Gluon kernels' markdown tables: every config (:func:`gluon_lines`), then the best per row against the
    issue's targets (:func:`gluon_best_lines`)."""
    lines = ["", "Warp-specialised Gluon kernels (`kimi_core.kernels.gluon_w4a16`, `gluon_w4a16_rs`; "
             "dispatched where `kimi_core.kernels.W4A16_GLUON` says):", "", GLUON_HEADER, "|" + "---|" * (GLUON_HEADER.count("|") - 1)]
    lines += [line for r in rows for line in gluon_lines(r)]
    lines += ["", "Best correct config per row (rel err vs BF16 <= 1e-2) against issue #21's targets:", "",
              BEST_HEADER, "|" + "---|" * (BEST_HEADER.count("|") - 1)]
    return lines + [gluon_best_lines(r) for r in rows if r.get("gluon")]


def pick_shapes(names: str | None, quick: bool = False) -> list:
    """The benchmark shapes named in ``names`` (comma-separated, as in :data:`SHAPES`; an unknown name is refused),
    K3 fc1 alone with ``quick``, else all."""
    if quick:
        return SHAPES[:1]
    if not names:
        return SHAPES
    by_name = {s[0]: s for s in SHAPES}
    wanted = [n.strip() for n in names.split(",")]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"--shapes: unknown shape(s) {unknown}; known: {list(by_name)}")
    return [by_name[n] for n in wanted]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the markdown tables to this file")
    ap.add_argument("--json", default=None, help="also write every measurement as JSON to this path")
    ap.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="K3 fc1 only")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names, e.g. 'K2 fc1,K2 fc2' (default: all)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per expert, comma-separated")
    ap.add_argument("--workspace-mib", type=int, default=None,
                    help=f"bound of the chunked path's workspace (sets {wc.WORKSPACE_ENV}; default 1024)")
    ap.add_argument("--alt-workspace-mib", type=int, default=None,
                    help="also time the chunked path under this bound (e.g. 96: one expert per buffer, L2-sized)")
    ap.add_argument("--sweep-ops", default="fwd,dgrad", help="with --sweep: the ops to time, comma-separated")
    ap.add_argument("--sweep-configs", default="",
                    help="with --sweep: only the configs whose label contains one of these comma-separated strings, "
                         "e.g. 'maxnreg,w8' (default: all; the shipped config is always timed)")
    ap.add_argument("--sweep", action="store_true",
                    help="time the fused kernels' tile configs instead of the table (--tokens among 8, 32, 64, "
                         "128, 512: the token counts SWEEP_FWD / SWEEP_DGRAD list)")
    ap.add_argument("--gluon", action="store_true",
                    help="also time the experimental warp-specialised Gluon forward and dgrad (issue #21; Hopper, "
                         "Triton >= 3.5)")
    ap.add_argument("--gluon-configs", default="auto",
                    help="with --gluon: comma-separated configs, 'auto' or <block_m>x<decode_warps>[s<load_stages>], "
                         "then n<block_n> (128 or 256 output columns per tile) and p (persistent schedule), "
                         "e.g. 128x8, 128x4s4, autop, auton256p; "
                         "rs[<block_m>][s<load_stages>][n<block_n>][k<mma_chunks>][o<ctas_per_sm>][a][p]: the forward "
                         "with the weights in the wgmma's registers")
    ap.add_argument("--gluon-only", action="store_true", help="with --gluon: time BF16 and the Gluon kernels only")
    ap.add_argument("--fused-options", default=None,
                    help="JSON keyword arguments added to kimi_core.kernels.FUSED_OPTIONS for both ops (the fused "
                         "columns, the dispatcher and --sweep), e.g. '{\"fold_scales\": true}'")
    args = ap.parse_args()
    shapes = pick_shapes(args.shapes, args.quick)
    if args.fused_options:
        for options in kernels.FUSED_OPTIONS.values():
            options.update(json.loads(args.fused_options))
    if args.sweep:
        return sweep(shapes, [int(t) for t in args.tokens.split(",")], args.out, args.sweep_ops.split(","),
                     [c for c in args.sweep_configs.split(",") if c])
    if args.workspace_mib is not None:
        os.environ[wc.WORKSPACE_ENV] = str(args.workspace_mib << 20)
    os.environ.pop(kernels.PATH_ENV, None)  # the auto column is the dispatcher's own choice
    torch.manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    gluon = args.gluon_configs.split(",") if args.gluon or args.gluon_only else None
    rows, decodes, lines, dlines = [], [], [], []
    print(GLUON_HEADER if args.gluon_only else HEADER, flush=True)
    for name, E, K, N in shapes:
        w_bf16 = None
        for fmt in FORMATS:
            wp, ws = random_weights(fmt, E, N, K)
            w_bf16 = bf16_layer(fmt, wp, ws, w_bf16)  # BF16 baseline: the same experts, one buffer for both formats
            for tpe in tokens:
                r = measure(name, E, K, N, fmt, wp, ws, w_bf16, tpe,
                            args.alt_workspace_mib << 20 if args.alt_workspace_mib else None, gluon, args.gluon_only)
                rows.append(r)
                if args.gluon_only:
                    print("\n".join(gluon_lines(r)), flush=True)
                else:
                    lines.append(format_row(r))
                    print(lines[-1], flush=True)
                torch.cuda.empty_cache()
            if args.gluon_only:
                del wp, ws
                continue
            d = measure_decode(name, E, K, N, fmt, wp, ws)
            decodes.append(d)
            dlines.append(f"| {name} | {'MXFP4' if fmt.startswith('mxfp4') else 'INT4'} | {d['experts']} "
                          f"| {d['ms']:.3f} | {d['read_gb']:.3f} | {d['written_gb']:.3f} | {d['tb_per_s']:.2f} |")
            del wp, ws
        del w_bf16
        torch.cuda.empty_cache()
    if dlines:
        print("\n" + DECODE_HEADER + "\n" + "\n".join(dlines), flush=True)
    import triton

    gpu = torch.cuda.get_device_name()
    cmd = "python " + " ".join(sys.argv)
    date = datetime.date.today().isoformat()
    bound = wc.workspace_bound()
    block = [f"\n## W4A16 grouped GEMM: BF16 vs fused vs chunked dequant+GEMM ({date}, {gpu}, commit {commit()})\n",
             f"Command: `{cmd}`; torch {torch.__version__}, triton {triton.__version__}. Median of {REPS} runs, "
             f"L2 flushed before each; BF16 and the auto path timed in turns (`timed_alternating`: both under the "
             "same recent load at the power cap), fused and chunked each on its own; random codes and scales, equal "
             "tokens per expert. Chunked workspace bound "
             f"{bound / 2**30:.2f} GiB; \"peak extra\" is what one chunked forward allocates above its inputs "
             "(output, workspace and per-chunk GEMM outputs). Speed vs BF16 = BF16 ms / ms (higher is faster); "
             "auto = `kimi_core.kernels.choose_path`, its tables = "
             f"`{_crossover_text()}`; roofline = max(bytes / {hbm_bytes_per_s() / 1e12:.2f} TB/s, FLOPs / 700 TFLOP/s) "
             "(bytes: packed weights, scales, activations in and out; TB/s and TFLOP/s are what the row achieved); host ms = "
             f"the Python call's own time (the GPU gets a {HEAD_START_MS:g} ms head start, so GPU ms are the kernels' alone; "
             "a host ms near the GPU ms means the call waits for the GPU).\n", HEADER,
             "|" + "---|" * (HEADER.count("|") - 1)]
    if args.gluon_only:  # the Gluon table alone
        block = [f"\n## W4A16 grouped GEMM: BF16 vs the experimental Gluon kernel ({date}, {gpu}, commit {commit()})\n",
                 f"Command: `{cmd}`; torch {torch.__version__}, triton {triton.__version__}. Median of {REPS} runs, "
                 "L2 flushed before each; random codes and scales, equal tokens per expert."]
        text = "\n".join(block + gluon_table(rows)) + "\n"
        return finish(args, text, rows, [], date, gpu, cmd, bound)
    block += lines + ["", targets_summary(rows)]
    block += ["", "Decode kernel alone (one workspace buffer of experts, bf16 written):", "", DECODE_HEADER,
              "|" + "---|" * (DECODE_HEADER.count("|") - 1)] + dlines
    if args.alt_workspace_mib:
        alt = ("| shape | tok/exp | fmt | chunks | chunked fwd ms | fwd speed vs BF16 | chunked dgrad ms "
               "| dgrad speed vs BF16 |")
        block += ["", f"Chunked path with a {args.alt_workspace_mib} MiB workspace instead:", "", alt,
                  "|" + "---|" * (alt.count("|") - 1)]
        block += [f"| {r['shape']} | {r['tokens_per_expert']} | {'MXFP4' if r['fmt'].startswith('mxfp4') else 'INT4'} "
                  f"| {r['alt_fwd_chunks']} | {r['alt_fwd_ms']:.3f} | {r['bf16_fwd_ms'] / r['alt_fwd_ms']:.2f}x "
                  f"| {r['alt_dgrad_ms']:.3f} | {r['bf16_dgrad_ms'] / r['alt_dgrad_ms']:.2f}x |" for r in rows]
    if args.gluon:
        block += gluon_table(rows)
    text = "\n".join(block) + "\n"
    finish(args, text, rows, decodes, date, gpu, cmd, bound)


def finish(args, text: str, rows: list[dict], decodes: list[dict], date: str, gpu: str, cmd: str, bound: int) -> None:
    """Write the markdown (``--out``), the JSON (``--json``) and append to RESULTS.md unless ``--no-append``."""
    import triton

    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        meta = dict(date=date, gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit(),
                    command=cmd, workspace_bytes=bound, crossover=_crossover_text())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, decode=decodes), f, indent=1)
    if not args.no_append:
        append(text)


def _crossover_text() -> str:
    """The dispatcher's tables as the benchmark ran them: the fused / chunked crossover, the Gluon ranges and the
    Gluon options."""
    tables = {name: {op: {str(k): v for k, v in t.items()} for op, t in table.items()}
              for name, table in (("W4A16_CROSSOVER", kernels.W4A16_CROSSOVER), ("W4A16_GLUON", kernels.W4A16_GLUON))}
    return json.dumps(dict(tables, GLUON_OPTIONS=kernels.GLUON_OPTIONS, FUSED_OPTIONS=kernels.FUSED_OPTIONS))


# the fused kernels' tile configs the sweep times: (BLOCK_M, BLOCK_N, num_warps, num_stages[, extra options]), the
# extras e.g. SPLIT_N (dgrad: the reduction in that many ranges), PERSISTENT (forward: that many programs per SM
# walking the tiles in one flattened, pipelined loop nest) or ROW_LOADS (a row's words of a step loaded as 64-byte
# runs along the row, 4 lanes per run, instead of 32 rows of 16 bytes per instruction)
RL = {"ROW_LOADS": True}
SWEEP_FWD = {8: [(16, 128, 4, 3), (16, 128, 4, 4), (16, 64, 4, 4, RL), (16, 128, 4, 3, RL), (16, 128, 4, 4, RL),
                 (16, 128, 8, 4, RL), (16, 64, 4, 6, RL), (16, 128, 4, 3, dict(RL, PERSISTENT=2)),
                 # the last wave's tiles split over the reduction (up to TAIL_SPLIT pieces on the resident programs
                 # the driver counts, or SLOTS_PER_SM), one K step per iteration
                 (16, 64, 4, 4, dict(RL, TAIL_SPLIT=4)), (16, 64, 4, 5, dict(RL, TAIL_SPLIT=4)),
                 # two K steps per iteration (K_PAIRS, shipped with 3 stages and the split): 2 stages; unsplit; the
                 # split sized for 5 programs per SM (the unsplit kernel's count; with MXFP4's exact decode,
                 # --fused-options '{"fold_scales": false}', the split kernel holds 4 and the launcher does not
                 # split: this entry is the split as sized before 2026-12-07)
                 (16, 64, 4, 2, dict(RL, TAIL_SPLIT=4, K_PAIRS=True)), (16, 64, 4, 3, dict(RL, K_PAIRS=True)),
                 (16, 64, 4, 3, dict(RL, TAIL_SPLIT=4, K_PAIRS=True, SLOTS_PER_SM=5))],
             32: [(32, 128, 4, 4), (32, 128, 4, 3, RL), (32, 128, 4, 4, RL), (32, 64, 4, 4, RL),
                  (32, 128, 4, 3, dict(RL, K_PAIRS=True)), (32, 64, 4, 3, dict(RL, K_PAIRS=True))],
             64: [(64, 128, 4, 3), (64, 128, 4, 3, RL), (64, 128, 4, 4, RL), (64, 64, 4, 4, RL),
                  (64, 128, 4, 3, dict(RL, K_PAIRS=True)), (64, 64, 4, 3, dict(RL, K_PAIRS=True))],
             128: [(32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                   (64, 256, 8, 3), (128, 256, 8, 3), (64, 128, 4, 3, RL), (128, 256, 8, 3, RL), (128, 128, 8, 3, RL)],
             512: [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (64, 256, 8, 3),
                   (128, 256, 8, 3), (256, 128, 8, 3)]}
SWEEP_DGRAD = {8: [(16, 64, 4, 4), (16, 32, 4, 4), (16, 64, 4, 4, RL), (16, 32, 4, 4, RL), (16, 128, 4, 4, RL),
                   (16, 64, 4, 4, dict(RL, SPLIT_N=2)), (16, 64, 4, 4, dict(RL, SPLIT_N=4)),
                   (16, 32, 4, 4, dict(RL, SPLIT_N=4)), (16, 64, 4, 4, dict(RL, SPLIT_N=8)),
                   (16, 32, 4, 4, dict(RL, SPLIT_N=8)),
                   # more programs per SM (sm_90a on the CPU, 2026-12-07, K2 fc2 split in 4, folded MXFP4 / INT4: the
                   # shipped tile 177 / 183 registers, 2 blocks; maxnreg 96: 94 / 96 without spilling, 5 blocks, 550 /
                   # 474 loop instructions against 525 / 443; 8 warps: 80 / 88 registers, 3 / 2 blocks of 8 warps)
                   (16, 64, 4, 4, dict(RL, maxnreg=96)), (16, 64, 4, 4, dict(RL, SPLIT_N=4, maxnreg=96)),
                   (16, 64, 8, 4, dict(RL, SPLIT_N=4)),
                   # capped, other splits (H100 2026-12-07: K2 fc2's 192 programs split in 4 capped, 768 on 660
                   # slots, ran 0.117-0.120 ms against the uncapped 2.9 waves' 0.100-0.103; these fill the slots
                   # differently: 2 -> 384, 3 -> 576, 5 -> 960, 6 -> 1152, 8 -> 1536 programs)
                   *((16, 64, 4, 4, dict(RL, SPLIT_N=n, maxnreg=96)) for n in (2, 3, 5, 6, 8))],
               32: [(32, 64, 4, 4), (32, 64, 4, 4, RL), (32, 32, 4, 4, RL)],
               64: [(64, 64, 4, 3), (64, 64, 4, 3, RL), (64, 32, 4, 4, RL)],
               128: [(64, 64, 4, 3), (32, 64, 4, 4), (64, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3),
                     (128, 32, 8, 3), (64, 64, 4, 3, RL)],
               512: [(64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)]}


def sweep_config(t: tuple) -> dict:
    return dict(BLOCK_M=t[0], BLOCK_N=t[1], num_warps=t[2], num_stages=t[3], **(t[4] if len(t) > 4 else {}))


def sweep_label(t: tuple) -> str:
    extra = t[4] if len(t) > 4 else {}
    return f"{t[0]}x{t[1]} w{t[2]} s{t[3]}" + "".join(
        f" {k.lower().replace('_n', '')}{'' if v is True else v}" for k, v in extra.items())


def sweep(shapes, tokens: list[int], out: str | None, ops=("fwd", "dgrad"), only: list[str] = ()) -> None:
    """Time the fused kernels' tile configs (:data:`SWEEP_FWD`, :data:`SWEEP_DGRAD`) next to BF16 ``_grouped_mm`` on
    ``shapes`` x both formats x ``tokens`` per expert x ``ops`` (used to pick ``fwd_config`` / ``dgrad_config``), each
    call with :data:`kimi_core.kernels.FUSED_OPTIONS` as the dispatcher passes them; prints each timing and a table of
    the best config per row (also written to ``out``). ``only``: time just the configs whose label contains one of
    these strings (the shipped config is always timed)."""
    lines = ["| shape | tok/exp | fmt | op | BF16 ms | shipped ms | best config | best ms | best speed vs BF16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, E, K, N in shapes:
        for fmt in FORMATS:
            wp, ws = random_weights(fmt, E, N, K)
            w_bf16 = bf16_layer(fmt, wp, ws)
            for tpe in tokens:
                T, splits = E * tpe, [tpe] * E
                x = torch.randn(T, K, device=DEV).bfloat16()
                dy = torch.randn(T, N, device=DEV).bfloat16()
                bf16 = bf16_ops(x, dy, w_bf16, torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * tpe)
                ops_here = [op for op in (("fwd", SWEEP_FWD, tw.grouped_gemm, x, bf16["fwd"]),
                                          ("dgrad", SWEEP_DGRAD, tw.grouped_gemm_dgrad, dy, bf16["dgrad"]))
                            if op[0] in ops]
                for kind, table, fn, a, baseline in ops_here:
                    t_bf16 = bench(baseline, reps=10)
                    opts = kernels.FUSED_OPTIONS[kind]
                    t_ship = bench(lambda: fn(a, wp, ws, fmt, splits, **opts), reps=10)  # the launcher's own choice
                    best = (t_ship, "shipped")
                    for cfg_t in table.get(tpe, ()):
                        label = sweep_label(cfg_t)
                        if only and not any(part in label for part in only):
                            continue
                        try:
                            t = bench(lambda: fn(a, wp, ws, fmt, splits, config=sweep_config(cfg_t), **opts), reps=10)
                        except Exception as exc:  # out of resources and the like
                            print(f"sweep {name} {fmt[:5]} {kind} tpe={tpe} {label}: failed {type(exc).__name__}: "
                                  f"{str(exc)[:100]}", flush=True)
                            continue
                        print(f"sweep {name} {fmt[:5]} {kind} tpe={tpe} {label}: {t:.3f} ms ({t_bf16 / t:.2f}x BF16 "
                              f"{t_bf16:.3f} ms) {2.0 * T * N * K / t / 1e9:.0f} TFLOP/s", flush=True)
                        best = min(best, (t, label))
                    lines.append(f"| {name} | {tpe} | {fmt_name(fmt)} | {kind} | {t_bf16:.3f} | {t_ship:.3f} | "
                                 f"{best[1]} | {best[0]:.3f} | {t_bf16 / best[0]:.2f}x |")
            del w_bf16
    text = "\n".join(lines + [f"\nFUSED_OPTIONS: {json.dumps(kernels.FUSED_OPTIONS)}"])
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
