"""Where the host time of one Gluon W4A16 call goes (issue #21): cProfile of repeated calls, top entries by own
and cumulative time. ``python benchmarks/w4a16_host_profile.py [tokens_per_expert] [fmt]`` (K3 fc1)."""
import cProfile
import io
import pstats
import sys
import time

import torch

import w4a16_grouped_gemm as wb
from kimi_core import kernels

tok = int(sys.argv[1]) if len(sys.argv) > 1 else 128
fmt = sys.argv[2] if len(sys.argv) > 2 else "mxfp4-pack-quantized"
_, E, K, N = wb.SHAPES[0]
wp, ws = wb.random_weights(fmt, E, N, K)
x = torch.randn(E * tok, K, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(E * tok, N, device="cuda", dtype=torch.bfloat16)
splits = [tok] * E
for op, fn in (("fwd", lambda: kernels.w4a16_grouped_gemm(x, wp, ws, fmt, splits, path="gluon")),
               ("dgrad", lambda: kernels.w4a16_grouped_gemm_dgrad(dy, wp, ws, fmt, splits, path="gluon"))):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    host = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(f"== {op} {tok} tok/exp {fmt}: host {host:.3f} ms per call (20 calls)\n{s.getvalue()}")
