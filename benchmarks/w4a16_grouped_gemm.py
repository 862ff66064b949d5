"""Benchmark of the W4A16 grouped GEMM (forward and dgrad) on MXFP4 and INT4 experts.

One run prints a table over the Kimi expert shapes and tokens per expert and appends it to
``benchmarks/RESULTS.md`` with date, GPU, commit and command. Columns: our forward and dgrad
(ms), BF16 ``torch._grouped_mm`` on bf16 copies of the same weights (ms), dequantize-then-
``_grouped_mm`` (ms, the whole layer dequantized with ``kimi_core.quant`` torch ops), forward
TFLOP/s, and forward / dgrad time as a percentage of the W4A16 roofline: ``max(bytes / 4.2 TB/s,
FLOPs / 700 TFLOP/s)`` with bytes = packed weights + scales + activations in + out.

Usage: ``python benchmarks/w4a16_grouped_gemm.py [--out rows.md] [--no-append] [--quick]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import append, git_commit  # noqa: E402

from kimi_core.kernels import triton_w4a16 as tw  # noqa: E402
from kimi_core.quant import dequantize  # noqa: E402

SHAPES = [("K3 fc1", 112, 3584, 6144), ("K3 fc2", 112, 3072, 3584), ("K2 fc1", 24, 7168, 4096),
          ("K2 fc2", 24, 2048, 7168)]
TOKENS = [8, 128, 512, 2048]
FORMATS = ["mxfp4-pack-quantized", "pack-quantized"]
HBM = 4.2e12
MMA = 700e12


def bench(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median ms of ``fn`` over ``reps`` CUDA-event-timed runs, L2 flushed before each."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def random_weights(fmt, E, N, K):
    if fmt == "mxfp4-pack-quantized":
        wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
        ws = torch.randint(118, 125, (E, N, K // 32), dtype=torch.uint8, device="cuda")
    else:
        wp = torch.randint(-(2**31), 2**31 - 1, (E, N, K // 8), dtype=torch.int64, device="cuda").to(torch.int32)
        ws = (torch.rand((E, N, K // 32), device="cuda") * 0.02 + 0.002).to(torch.bfloat16)
    return wp, ws


def commit() -> str:
    return git_commit(default="uncommitted")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the table rows to this file")
    ap.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="K3 fc1 only")
    ap.add_argument("--deq-reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time tile configs on K3 fc1 instead of the table")
    args = ap.parse_args()
    if args.sweep:
        return sweep()
    torch.manual_seed(0)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = []
    header = ("| shape | E | K | N | tok/exp | fmt | fwd ms | dgrad ms | bf16 grouped_mm ms | deq+grouped_mm ms "
              "| fwd TFLOP/s | fwd % roofline | dgrad % roofline | bf16/fwd | dgrad/fwd | deq+mm/fwd |")
    print(header, flush=True)
    for name, E, K, N in shapes:
        w_bf16 = None
        for fmt in FORMATS:
            wp, ws = random_weights(fmt, E, N, K)
            if w_bf16 is None:  # BF16 baseline: the same experts, dequantized once, [E, N, K]
                w_bf16 = torch.empty((E, N, K), dtype=torch.bfloat16, device="cuda")
                for e in range(E):
                    w_bf16[e] = dequantize(fmt, wp[e], ws[e], torch.bfloat16)
            w_bytes = wp.numel() * wp.element_size() + ws.numel() * ws.element_size()
            for tpe in TOKENS:
                T = E * tpe
                splits = [tpe] * E
                offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * tpe
                x = torch.randn(T, K, device="cuda").bfloat16()
                dy = torch.randn(T, N, device="cuda").bfloat16()
                y = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
                dx = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
                t_fwd = bench(lambda: tw.grouped_gemm(x, wp, ws, fmt, splits, out=y))
                t_dg = bench(lambda: tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, out=dx))
                t_bf = bench(lambda: torch._grouped_mm(x, w_bf16.transpose(1, 2), offs=offs))

                def deq_mm():
                    w = dequantize(fmt, wp, ws, torch.bfloat16)
                    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

                t_dq = bench(deq_mm, reps=args.deq_reps, warmup=1)
                flops = 2.0 * T * N * K
                roof_f = max((w_bytes + 2 * T * (K + N)) / HBM, flops / MMA) * 1e3
                row = (f"| {name} | {E} | {K} | {N} | {tpe} | {'MXFP4' if fmt.startswith('mxfp4') else 'INT4'} "
                       f"| {t_fwd:.3f} | {t_dg:.3f} | {t_bf:.3f} | {t_dq:.2f} | {flops / t_fwd / 1e9:.0f} "
                       f"| {100 * roof_f / t_fwd:.0f}% | {100 * roof_f / t_dg:.0f}% | {t_bf / t_fwd:.2f}x "
                       f"| {t_dg / t_fwd:.2f} | {t_dq / t_fwd:.1f}x |")
                print(row, flush=True)
                rows.append(row)
                del x, dy, y, dx
            del wp, ws
        del w_bf16
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    cmd = "python " + " ".join(sys.argv)
    import triton

    block = [f"\n## W4A16 grouped GEMM ({datetime.date.today().isoformat()}, {gpu}, commit {commit()})\n",
             f"Command: `{cmd}`; torch {torch.__version__}, triton {triton.__version__}. "
             "Median of 20 runs (dequantize+mm: 3), L2 flushed before each. Random codes and scales; "
             "roofline = max(bytes / 4.2 TB/s, FLOPs / 700 TFLOP/s).\n", header,
             "|" + "---|" * (header.count("|") - 1)]
    block += rows
    text = "\n".join(block) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if not args.no_append:
        append(text)


def sweep() -> None:
    """Time a few tile configurations on K3 fc1 (used to pick ``fwd_config`` / ``dgrad_config``)."""
    name, E, K, N = SHAPES[0]
    fwd = {8: [(16, 64, 4, 4), (16, 128, 4, 4), (16, 128, 4, 6), (16, 256, 4, 4), (16, 256, 8, 4), (16, 128, 8, 4)],
           128: [(32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                 (64, 256, 8, 3), (128, 256, 8, 3)],
           512: [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (64, 256, 8, 3),
                 (128, 256, 8, 3), (256, 128, 8, 3)]}
    dg = {8: [(16, 64, 4, 4), (16, 32, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4)],
          128: [(64, 64, 4, 3), (32, 64, 4, 4), (64, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)],
          512: [(64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)]}
    for fmt in FORMATS:
        wp, ws = random_weights(fmt, E, N, K)
        for tpe in (8, 128, 512):
            T = E * tpe
            splits = [tpe] * E
            x = torch.randn(T, K, device="cuda").bfloat16()
            dy = torch.randn(T, N, device="cuda").bfloat16()
            for kind, table, fn, a in (("fwd", fwd, tw.grouped_gemm, x), ("dgrad", dg, tw.grouped_gemm_dgrad, dy)):
                for bm, bn, nw, ns in table[tpe]:
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
                    try:
                        t = bench(lambda: fn(a, wp, ws, fmt, splits, config=dict(cfg)), reps=10)
                        print(f"sweep {fmt[:5]} {kind} tpe={tpe} {bm}x{bn} w{nw} s{ns}: {t:.3f} ms "
                              f"{2.0 * T * N * K / t / 1e9:.0f} TFLOP/s", flush=True)
                    except Exception as exc:  # out of resources and the like
                        print(f"sweep {fmt[:5]} {kind} tpe={tpe} {bm}x{bn} w{nw} s{ns}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)


if __name__ == "__main__":
    main()
