"""First look at the experimental Gluon W4A16 kernels on a Hopper GPU: each variant (forward / dgrad of
``gluon_w4a16`` and the register-fragment forward of ``gluon_w4a16_rs``, x MXFP4 / INT4) on one small ragged case
in its own subprocess under a short timeout, so a barrier bug that hangs one variant still leaves the others'
results. Prints per variant: compile + first run seconds, max |err| and relative error against
the float32 oracle of exactly dequantized weights, and whether unwritten rows (NaN poison) remain. Each runs once
with one program per tile and once persistent on 2 programs (each then walks several tiles, its rings running on
across them: a parity slip there hangs or corrupts the next tile).

    python3 tests/gpu/gluon_probe.py                   # all 32 variants, 60 s each ($GLUON_PROBE_OPS: only these ops)
    python3 tests/gpu/gluon_probe.py one mxfp4 fwd 2   # one variant in this process (programs: 0 = one per tile;
                                                       # op: fwd, dgrad, or rs = the register-fragment forward,
                                                       # rsn128 = it with 128 columns and 256 rows per tile,
                                                       # k4 = 4 wgmmas per K step, o2 = 2 programs per SM,
                                                       # a = decode ahead; rsd = the register-fragment
                                                       # dgrad, rsdn128a: 128 columns, decode ahead; a
                                                       # trailing f: MXFP4 scales folded, one multiply)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def one(fmt_name: str, op: str, programs: int) -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kimi_core", "kernels")]
    import torch
    from w4a16_cases import INT4, MXFP4, oracle_dgrad, oracle_fwd, random_packed

    from kimi_core.kernels import gluon_w4a16 as gw

    fmt = {"mxfp4": MXFP4, "int4": INT4}[fmt_name]
    E, N, K, splits = 3, 256, 512, [70, 0, 130] if not op.startswith("rsn128") else [300, 0, 130]
    wp, ws = random_packed(fmt, E, N, K, seed=1, device="cuda")
    T = sum(splits)
    dgrad = op == "dgrad" or op.startswith("rsd")
    a = torch.randn(T, N if dgrad else K, device="cuda").bfloat16()
    out = torch.full((T, K if dgrad else N), float("nan"), dtype=torch.bfloat16, device="cuda")
    t0 = time.time()
    if op.startswith("rsd"):  # the register-fragment dgrad (rsd: 256 columns; rsdn128a: 128, decode ahead)
        from kimi_core.kernels import gluon_w4a16_rs as rs

        rs.grouped_gemm_dgrad(a, wp, ws, fmt, splits, out=out, persistent=programs or False,
                              block_n=128 if "n128" in op else 256, decode_ahead="a" in op[3:],
                              fold_scales=op.endswith("f"))
    elif op.startswith("rs"):  # the forward with the weights in the wgmma's registers (rsn128: 256 rows x 128 cols;
        from kimi_core.kernels import gluon_w4a16_rs as rs  # k4: 4 wgmmas per K step; o2: 2 programs per SM;
        # a: decode ahead (rsn128a...)

        rs.grouped_gemm(a, wp, ws, fmt, splits, out=out, persistent=programs or False,
                        block_n=128 if op.startswith("rsn128") else 256, mma_chunks=4 if "k4" in op else 1,
                        decode_ahead="a" in op, fold_scales=op.endswith("f"),
                        **({"ctas_per_sm": 2, "block_m": 16} if "o2" in op else {}))
    else:
        (gw.grouped_gemm_dgrad if op == "dgrad" else gw.grouped_gemm)(a, wp, ws, fmt, splits, out=out,
                                                                       persistent=programs or False)
    torch.cuda.synchronize()
    dt = time.time() - t0
    ref = (oracle_dgrad if dgrad else oracle_fwd)(a, wp, ws, fmt, splits)
    got = out.float()
    nan_rows = int(torch.isnan(got).any(dim=1).sum())
    err = (got.nan_to_num(0) - ref).abs()
    rel = float(err.norm() / ref.norm())
    print(f"{fmt_name} {op} programs {programs or 'per tile'}: first run {dt:.1f} s, max|err| {float(err.max()):.3e}, "
          f"rel {rel:.2e}, rows with NaN {nan_rows}/{T}", flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        one(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    timeout = int(os.environ.get("GLUON_PROBE_TIMEOUT", "60"))
    bad = 0
    for fmt in ("mxfp4", "int4"):
        for op in os.environ.get("GLUON_PROBE_OPS", "fwd,dgrad,rs,rsn128,rsn128k4,rsk4o2,rsn128a,rsn128ao2,rsd,rsdn128,rsdn128a,rsn128af,rsdn128af").split(","):
            for programs in ("0", "2"):  # one program per tile (the binary compiles once), then 2 persistent ones
                name = f"{fmt} {op} programs {programs}"
                try:
                    r = subprocess.run([sys.executable, __file__, "one", fmt, op, programs], capture_output=True,
                                       text=True, timeout=timeout)
                    print(r.stdout.strip() or f"{name}: rc={r.returncode}\n{r.stderr[-3000:]}", flush=True)
                    bad += r.returncode != 0
                except subprocess.TimeoutExpired:
                    print(f"{name}: TIMEOUT after {timeout} s (hang: a barrier never completes?)", flush=True)
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
