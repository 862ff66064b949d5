"""Nsight Compute profile of one W4A16 expert GEMM next to BF16 ``_grouped_mm`` (issue #21: where a speed target
is missed, the profile that explains the gap).

Two modes. ``run``: one call of one path on one benchmark shape (``benchmarks/w4a16_grouped_gemm.py``'s random
weights, equal tokens per expert), after warm-up calls, inside the NVTX range ``profile``, so that

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section SchedulerStats --section WarpStateStats \\
        --metrics sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed --print-details all \\
        --csv --page details \\
        python benchmarks/w4a16_ncu_profile.py run --shape "K3 fc1" --tokens 2048 --fmt mxfp4 --op fwd --path gluon

profiles exactly that call's kernels. ``summarize CSV...``: one markdown row per profiled kernel (duration, SM and
DRAM throughput, issue slots busy, eligible warps per scheduler, tensor pipe busy, the top warp stall reasons), from
those CSVs.
``bash tests/gpu/h200_session.sh w4a16_profile`` runs the cases of issue #21's table on the GPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

FORMATS = {"mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized"}
# the share of elapsed cycles the SMs' tensor pipe (wgmma and mma) was busy, which the sections do not report: asked
# for with ncu's --metrics as <base>.avg.pct_of_peak_sustained_elapsed, the base being the first of these names that
# the installed ncu lists for the GPU (--query-metrics; the names differ between ncu releases)
TENSOR_PIPE_BASES = ("sm__pipe_tensor_cycles_active", "sm__pipe_tensor_op_gmma_cycles_active",
                     "sm__pipe_tensor_op_hmma_cycles_active")
TENSOR_PIPE = "tensor pipe"  # the summary's key for whichever of them was profiled
# ncu metrics a summary row shows: (section's metric name, column)
COLUMNS = [("Duration", "ms"), ("Compute (SM) Throughput", "SM %"), ("DRAM Throughput", "DRAM %"),
           ("Memory Throughput", "memory %"), ("Issue Slots Busy", "issue slots busy %"),
           ("Executed Ipc Active", "IPC"), ("Eligible Warps Per Scheduler", "eligible warps / scheduler"),
           ("No Eligible", "no eligible %"), ("Warp Cycles Per Issued Instruction", "cycles / issued inst"),
           (TENSOR_PIPE, "tensor pipe active %")]


def run(args) -> None:
    """One warm call of ``args.path`` (``bf16``, ``fused``, ``chunked``, ``gluon``) inside the NVTX range."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import w4a16_grouped_gemm as wb

    from kimi_core import kernels
    from kimi_core.quant import dequantize

    name, E, K, N = next(s for s in wb.SHAPES if s[0] == args.shape)
    fmt = FORMATS[args.fmt]
    torch.manual_seed(0)
    wp, ws = wb.random_weights(fmt, E, N, K)
    T = E * args.tokens
    splits = [args.tokens] * E
    a = torch.randn(T, K if args.op == "fwd" else N, device="cuda").bfloat16()
    if args.path == "bf16":
        w = dequantize(fmt, wp, ws, torch.bfloat16)
        del wp, ws
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * args.tokens
        rhs = w.transpose(1, 2) if args.op == "fwd" else w
        fn = lambda: torch._grouped_mm(a, rhs, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        op = kernels.w4a16_grouped_gemm if args.op == "fwd" else kernels.w4a16_grouped_gemm_dgrad
        fn = lambda: op(a, wp, ws, fmt, splits, path=args.path)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(paths: list[str]) -> str:
    """Markdown table of the ncu CSVs (``--csv --page details``): one row per kernel of each file, the columns of
    :data:`COLUMNS` and the three largest warp stall reasons (``WarpStateStats`` with ``--print-details all``)."""
    head = "| case | kernel | " + " | ".join(c for _, c in COLUMNS) + " | top stalls (cycles per issued inst) |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for path in paths:
        kernels: dict[str, dict] = {}
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if len(r) > 10]
        if not rows:
            lines.append(f"| {os.path.basename(path)} | no kernel profiled | " + " | " * len(COLUMNS))
            continue
        hdr = rows[0]
        col = {k: i for i, k in enumerate(hdr)}
        for r in rows[1:]:
            key = r[col["ID"]] + " " + r[col["Kernel Name"]][:40]
            m = kernels.setdefault(key, {"stalls": {}})
            metric, unit, value = r[col["Metric Name"]], r[col["Metric Unit"]], _number(r[col["Metric Value"]])
            if value is None:
                continue
            if metric == "Duration":  # ms
                value = value / {"ns": 1e6, "us": 1e3, "usecond": 1e3, "nsecond": 1e6, "ms": 1.0, "msecond": 1.0}.get(unit, 1.0)
            if metric.startswith(TENSOR_PIPE_BASES):
                metric = TENSOR_PIPE
            if metric.startswith("Stall ") or metric.startswith("smsp__average_warp"):
                m["stalls"][metric] = value
            m.setdefault(metric, value)
        case = os.path.splitext(os.path.basename(path))[0]
        for key, m in kernels.items():
            top = sorted(m["stalls"].items(), key=lambda kv: -kv[1])[:3]
            cells = [f"{m[k]:.3g}" if k in m else "" for k, _ in COLUMNS]
            lines.append(f"| {case} | {key} | " + " | ".join(cells) + " | "
                         + ", ".join(f"{k.removeprefix('Stall ')} {v:.2g}" for k, v in top) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="one warm call inside the NVTX range 'profile'")
    r.add_argument("--shape", default="K3 fc1")
    r.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    r.add_argument("--fmt", choices=sorted(FORMATS), default="mxfp4")
    r.add_argument("--op", choices=["fwd", "dgrad"], default="fwd")
    r.add_argument("--path", choices=["bf16", "fused", "chunked", "gluon"], default="gluon")
    sub.add_parser("tensor-metric", help="the --metrics argument for the tensor pipe, from ncu --query-metrics "
                   "output on stdin (nothing where no name of TENSOR_PIPE_BASES is listed)")
    s = sub.add_parser("summarize", help="markdown table of ncu --csv --page details files")
    s.add_argument("csv", nargs="+")
    args = ap.parse_args()
    if args.mode == "run":
        run(args)
    elif args.mode == "tensor-metric":
        listed = {line.split()[0] for line in sys.stdin if line.split()}
        print(next((f"{b}.avg.pct_of_peak_sustained_elapsed" for b in TENSOR_PIPE_BASES if b in listed), ""))
    else:
        print(summarize(args.csv))


if __name__ == "__main__":
    main()
