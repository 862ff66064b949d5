"""Registers, spills and resident blocks per SM of the fused Triton W4A16 kernels
(:mod:`kimi_core.kernels.w4a16.fused`) at 8 tokens per expert, compiled for sm_90a on a CPU machine with the GPU's
Triton (no GPU needed).

Compiled as the launcher's calls are specialized at the benchmark shapes (16-byte aligned pointers, every int that is
a multiple of 16 marked so, K3's 112 experts but not K2's 24, a split dgrad's fp32 partial sums): without that the
loads are not vectorized, and even an unused int's divisibility changes ptxas's allocation. The forward rows compile
the shipped plan (:func:`plans.fwd_config`), the dgrad rows the launcher's plan at 8 tok/exp on 132 SMs
(:func:`plans.dgrad_occupancy`). docs/performance.md#w4a16-launch-plans lists what these counts chose.

    python tools/kernels/fused_sm90_resources.py    # from the project root, with the GPU's Triton installed
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_cubin import blocks_per_sm, mma_loop, resource_usage, sass_instructions

from kimi_core.kernels.w4a16.format_ids import FMT_INT4, FMT_MXFP4, FMT_MXFP4_FOLDED
from kimi_core.kernels.w4a16.fused import plans
from kimi_core.kernels.w4a16.fused.dgrad import w4a16_dgrad_perm_kernel
from kimi_core.kernels.w4a16.fused.forward import w4a16_fwd_perm_kernel
from kimi_core.kernels.w4a16.fused.launch import num_programs

FORMATS = {"mxfp4": (FMT_MXFP4, "*u8"), "mxfp4 folded": (FMT_MXFP4_FOLDED, "*u8"), "int4": (FMT_INT4, "*bf16")}


def signature(kernel, scale_type: str, partial_sums: bool = False) -> dict:
    """Argument types of a fused kernel: pointers by name (``ws_ptr``: the format's scale type, ``wq_ptr``: int32
    words, ``offsets_ptr``: int32, ``dx_ptr``: fp32 where ``partial_sums`` (a split dgrad), other ``*_ptr``: bf16),
    the rest int32 unless constexpr."""
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name == "ws_ptr":
            sig[p.name] = scale_type
        elif p.name in ("wq_ptr", "offsets_ptr", "count_ptr"):
            sig[p.name] = "*i32"
        elif p.name == "part_ptr":
            sig[p.name] = "*fp32"
        elif p.name == "dx_ptr" and partial_sums:
            sig[p.name] = "*fp32"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*bf16"
        else:
            sig[p.name] = "i32"
    return sig


def compile_fused(op: str, fmt: str, config: dict, experts: int = 112):
    """One fused kernel (``op`` fwd / dgrad, permuted word decode) in ``config`` (a shipped config dict) for sm_90a,
    specialized as the launcher's call on a layer of ``experts`` experts at the benchmark shapes is; returns the
    compiled kernel."""
    fmt_id, scale_type = FORMATS[fmt]
    cfg = dict(config)
    options = {k: cfg.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}
    kernel = w4a16_fwd_perm_kernel if op == "fwd" else w4a16_dgrad_perm_kernel
    const = dict(
        FMT=fmt_id,
        GROUP_M=8,
        E_POW2=triton.next_power_of_2(experts),
        USE_ASM=True,
        INTERP=False,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        ROW_LOADS=cfg.get("ROW_LOADS", False),
    )
    if op == "dgrad":
        const.update(EVEN_N=True, SPLIT_N=cfg.get("SPLIT_N", 1))
    else:
        const.update(
            PERSISTENT=bool(cfg.get("PERSISTENT", 0)),
            TAIL_SPLIT=cfg.get("TAIL_SPLIT", 1),
            K_PAIRS=cfg.get("K_PAIRS", False),
        )
    sig = signature(kernel, scale_type, cfg.get("SPLIT_N", 1) > 1)
    if op == "fwd" and const["TAIL_SPLIT"] == 1:  # the launcher passes no tail buffers: None, a constexpr
        const.update(part_ptr=None, count_ptr=None)
        sig.update(part_ptr="constexpr", count_ptr="constexpr")
    # Triton's runtime specialization of the launcher's arguments at the benchmark shapes: every pointer 16-byte
    # aligned, every int a multiple of 16 but E where it is not (K2's 24 experts); stride_part is 0 or T * K. Leaving
    # out an int the runtime specializes changes ptxas's allocation
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, t) in enumerate(sig.items())
        if t != "constexpr" and not (name == "E" and experts % 16)
    }
    src = ASTSource(kernel, sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    print(
        "| op | fmt | layer | config | REG / STACK / LOCAL | SASS instructions | K loop SASS "
        "| blocks per SM (registers, shared) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    # (op, layer label, experts, dgrad output width K, extra config): the dgrad compiled as the launcher plans it at 8
    # tok/exp on 132 SMs (plans.dgrad_occupancy over the launcher's program count)
    sms = 132
    variants = [
        ("fwd", "K3", 112, 0, {}),
        ("fwd", "K2", 24, 0, {}),
        ("dgrad", "K3", 112, 3584, {}),
        ("dgrad", "K2 fc1", 24, 7168, {}),
        ("dgrad", "K2 fc2", 24, 2048, {}),
        ("fwd", "K3", 112, 0, {"PERSISTENT": 2}),
    ]  # the experimental walk
    for op, layer, experts, K, extra in variants:
        for fmt in FORMATS:
            fmt_name = "mxfp4" if fmt.startswith("mxfp4") else "int4"
            if op == "fwd":
                cfg = dict(plans.fwd_config(8, fmt_name), **extra)
            else:
                cfg = plans.dgrad_config(8, fmt_name)
                programs = num_programs([8] * experts, 8 * experts, experts, cfg["BLOCK_M"], K // 256)
                cfg = plans.dgrad_occupancy(cfg, programs, sms, FORMATS[fmt][0])
            k = compile_fused(op, fmt, cfg, experts)
            usage = resource_usage(k.asm["cubin"])
            regs = int(usage.split()[0].split(":")[1])
            by_regs, by_shared = blocks_per_sm(regs, cfg["num_warps"], k.metadata.shared)
            label = (
                f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                + (" row loads" if cfg.get("ROW_LOADS") else "")
                + (" k pairs" if cfg.get("K_PAIRS") else "")
                + (f" tail split {cfg['TAIL_SPLIT']}" if cfg.get("TAIL_SPLIT", 1) > 1 else "")
                + "".join(f" {key.lower()} {cfg[key]}" for key in ("SPLIT_N", "maxnreg", "PERSISTENT") if key in cfg)
            )
            print(
                f"| {op} | {fmt} | {layer} | {label} | {usage.replace('SHARED:', 'SHARED(static):')} | "
                f"{sass_instructions(k.asm['cubin'])} | {mma_loop(k.asm['cubin'])[0]} | {by_regs}, {by_shared} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
