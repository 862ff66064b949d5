"""Registers, spills and resident blocks per SM of the fused Triton W4A16 kernels (issue #21's 8 tokens/expert rows),
compiled for sm_90a on a CPU machine with the GPU's Triton (3.6.0; setup as in tests/gpu/gluon_sm90_compile_check.py).

At 8 tokens per expert these kernels are memory-bound: 48-61 % of an H100's HBM bandwidth with the weight tile
loaded as ``[BN, 4, 4]`` (a warp's lanes on 32 rows of 16 bytes; Nsight Compute: MIO throttle first), 51-78 % with
the shipped row loads (``ROW_LOADS``: 4 lanes per row's 64 bytes; ed6197c's table in benchmarks/RESULTS.md). This
prints, for each shipped 8 tok/exp config, what ptxas makes of it, compiled with the launcher's specialization at the
benchmark shapes (16-byte aligned pointers, ints multiples of 16): without it the loads are not vectorized and the
register counts are far off.

    /tmp/tri36/venv/bin/python tests/gpu/fused_sm90_resources.py
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_cubin import blocks_per_sm, resource_usage, sass_instructions  # noqa: E402

from kimi_core.kernels import triton_w4a16 as tw  # noqa: E402

FORMATS = {"mxfp4": (tw.FMT_MXFP4, "*u8"), "int4": (tw.FMT_INT4, "*bf16")}


def signature(kernel, scale_type: str) -> dict:
    """Argument types of a fused kernel: pointers by name (``ws_ptr``: the format's scale type, ``wq_ptr``: int32
    words, ``offsets_ptr``: int32, other ``*_ptr``: bf16), the rest int32 unless constexpr."""
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name == "ws_ptr":
            sig[p.name] = scale_type
        elif p.name in ("wq_ptr", "offsets_ptr"):
            sig[p.name] = "*i32"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*bf16"
        else:
            sig[p.name] = "i32"
    return sig


def compile_fused(op: str, fmt: str, config: dict):
    """One fused kernel (``op`` fwd / dgrad, permuted word decode) in ``config`` (a shipped config dict) for sm_90a;
    returns the compiled kernel."""
    fmt_id, scale_type = FORMATS[fmt]
    cfg = dict(config)
    options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    kernel = tw.w4a16_fwd_perm_kernel if op == "fwd" else tw.w4a16_dgrad_perm_kernel
    const = dict(FMT=fmt_id, GROUP_M=8, E_POW2=128, USE_ASM=True, INTERP=False, BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], ROW_LOADS=cfg.get("ROW_LOADS", False))
    if op == "dgrad":
        const.update(EVEN_N=True, SPLIT_N=cfg.get("SPLIT_N", 1))
    else:
        const.update(PERSISTENT=bool(cfg.get("PERSISTENT", 0)))
    sig = signature(kernel, scale_type)
    # what the launcher's specialization tells the compiler at the benchmark shapes: every pointer 16-byte aligned and
    # every int but E (24 for K2) a multiple of 16, so loads can be vectorized
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(sig.items())
               if t != "constexpr" and name not in ("E", "stride_part")}
    src = ASTSource(kernel, sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    print("| op | fmt | config | REG / STACK / LOCAL | SASS instructions | blocks per SM (registers, shared) |")
    print("|---|---|---|---|---|---|")
    variants = [(op, shipped, fmt, {}) for op, shipped in (("fwd", tw.fwd_config), ("dgrad", tw.dgrad_config))
                for fmt in FORMATS]
    variants += [("fwd", tw.fwd_config, fmt, {"PERSISTENT": 2}) for fmt in FORMATS]  # the experimental walk
    for op, shipped, fmt, extra in variants:
        cfg = dict(shipped(8, "mxfp4-pack-quantized" if fmt == "mxfp4" else "pack-quantized"), **extra)
        k = compile_fused(op, fmt, cfg)
        usage = resource_usage(k.asm["cubin"])
        regs = int(usage.split()[0].split(":")[1])
        by_regs, by_shared = blocks_per_sm(regs, cfg["num_warps"], k.metadata.shared)
        label = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}" + (
            " row loads" if cfg.get("ROW_LOADS") else "") + (" persistent" if extra else "")
        print(f"| {op} | {fmt} | {label} | {usage.replace('SHARED:', 'SHARED(static):')} | "
              f"{sass_instructions(k.asm['cubin'])} | {by_regs}, {by_shared} |", flush=True)


if __name__ == "__main__":
    main()
