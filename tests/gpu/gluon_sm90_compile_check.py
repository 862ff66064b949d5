"""Compile a Gluon (Triton's explicit-layout dialect) Hopper wgmma kernel for the H200 (sm_90a) on a CPU machine.

Issue #21 needs a W4A16 grouped GEMM that decodes 4-bit weights in some warps while others run wgmma; Triton's
Gluon (``triton.experimental.gluon``: shared-memory layouts, ``warpgroup_mma``, mbarriers, ``warp_specialize``)
writes that in Python. The H200's torch 2.11 ships Triton 3.6.0, and its wheel bundles ``ptxas``, so a kernel's
layouts, PTX and cubin can be checked here without device time. This script is that check on a one-tile bf16
wgmma (``wgmma.mma_async`` must appear in the PTX for ``.target sm_90a``); it printed, on 2026-12-03:
``triton 3.6.0 | wgmma in PTX: True | .target ['.target sm_90a'] | cubin bytes 23824`` (about 24 kB).

    python3 -m pip download --no-deps --only-binary=:all: triton==3.6.0 -d /tmp/tri36   # the H200's Triton
    python3 -m venv /tmp/tri36/venv && /tmp/tri36/venv/bin/pip install /tmp/tri36/triton-3.6.0-*.whl
    /tmp/tri36/venv/bin/python tests/gpu/gluon_sm90_compile_check.py
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def tile_mma(a_ptr, b_ptr, c_ptr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, blocked))
    a = gl.load(a_ptr + rows[:, None] * BK + cols[None, :])
    krow = gl.arange(0, BK, layout=gl.SliceLayout(1, blocked))
    ncol = gl.arange(0, BN, layout=gl.SliceLayout(0, blocked))
    b = gl.load(b_ptr + krow[:, None] * BN + ncol[None, :])
    a_s = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [BK, BN], gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))
    a_s.store(a)
    b_s.store(b)
    fence_async_shared()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_l)
    acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out = gl.convert_layout(acc, blocked)
    orow = gl.arange(0, BM, layout=gl.SliceLayout(1, blocked))
    gl.store(c_ptr + orow[:, None] * BN + ncol[None, :], out)


src = GluonASTSource(tile_mma, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "BM": "constexpr",
                                "BN": "constexpr", "BK": "constexpr"}, constexprs={"BM": 64, "BN": 64, "BK": 64})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = k.asm["ptx"]
targets = [line for line in ptx.splitlines() if line.startswith(".target")]
print("triton", triton.__version__, "| wgmma in PTX:", "wgmma.mma_async" in ptx, "| .target", targets,
      "| cubin bytes", len(k.asm["cubin"]))

# the experimental warp-specialised W4A16 kernel of issue #21, forward and dgrad, both formats (needs torch
# importable, as kimi_core.kernels is; run from the project root)
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_cubin import mma_loop, resource_usage  # noqa: E402

from kimi_core.kernels import gluon_w4a16 as gw  # noqa: E402
from kimi_core.kernels.triton_w4a16 import FMT_INT4 as INT4, FMT_MXFP4 as MXFP4  # noqa: E402


def desc_sig(dtype: str, block: list[int], gl_dtype, layout=None) -> str:
    """The launcher's signature string of a host TensorDescriptor argument (``tensordesc<dtype[block],layout>``;
    ``layout``: default swizzle unless given)."""
    layout = layout or gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def compile_w4a16(kernel, dgrad: int, bm: int, bn: int, ws: str, constexprs: dict, num_warps: int,
                  maxnreg: int | None = None, scales_t: bool = False):
    """Compile one Gluon W4A16 kernel variant for sm_90a (its launcher's signature: the three TMA descriptors of
    :func:`gw.descriptor_blocks`, the output / tile-table pointers and the int arguments, then ``constexprs``;
    ``maxnreg``: the launch's register cap); asserts it fits one H200 block (<= 227 KB shared) without spills. Returns ``(compiled, ptx, resource usage)``."""
    a_block, p_block, s_block = gw.descriptor_blocks(dgrad, bm, 1 if ws == "u8" else 2, bn, scales_t)
    sig = {"a_desc": desc_sig("bf16", a_block, gl.bfloat16), "p_desc": desc_sig("u8", p_block, gl.uint8),
           "s_desc": desc_sig(ws, s_block, None, gw.scale_smem_layout(s_block, 1 if ws == "u8" else 2, scales_t)),
           "out_ptr": "*bf16", "tiles_ptr": "*i32", "n_tiles": "i32", "n_col_tiles": "i32", "N": "i32", "K": "i32",
           "stride_om": "i32", **{n: "constexpr" for n in constexprs}}
    k = triton.compile(GluonASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    usage = resource_usage(k.asm["cubin"])
    assert k.metadata.shared <= 227 * 1024, f"{k.metadata.shared} B of shared memory: over the H200's 227 KB a block"
    assert " LOCAL:0" in usage and " STACK:0" in usage, f"spills: {usage}"
    return k, k.asm["ptx"], usage


def wgmma_serialization_warnings(ptx: str) -> list[str]:
    """ptxas's (Triton's wheel) warnings that it serialized wgmmas (``C7510``-``C7519``, e.g. C7513: a non-wgmma
    instruction defines a register that an in-flight wgmma reads), from re-assembling ``ptx`` for sm_90a; Triton's
    own ptxas run does not show them."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        open(src, "w").write(ptx)
        done = subprocess.run([tool, "-arch=sm_90a", "-o", os.path.join(tmp, "k.cubin"), src], capture_output=True,
                              text=True)
    assert done.returncode == 0, f"ptxas failed: {done.stderr[-2000:]}"
    return [line for line in done.stderr.splitlines() if re.search(r"C751\d", line)]


def assert_register_wgmma(ptx: str) -> bool:
    """The RS kernel's wgmmas take A from registers (a register list ``{%r..}``, not a shared-memory descriptor) and
    ptxas serializes none of them; returns True for the printout."""
    rs_form = any("wgmma.mma_async" in line and ", {%r" in line for line in ptx.splitlines())
    assert rs_form, "the RS kernel's wgmma must take A from registers"
    serialized = wgmma_serialization_warnings(ptx)
    assert not serialized, f"ptxas serializes the wgmmas of this variant: {serialized}"
    return rs_form


def dump(k, name: str) -> None:
    """``GLUON_DUMP=<prefix>``: write the variant's PTX, TTGIR and cubin beside ``<prefix>_<name>``."""
    if os.environ.get("GLUON_DUMP"):
        base = f"{os.environ['GLUON_DUMP']}_{name}"
        open(base + ".ptx", "w").write(k.asm["ptx"])
        open(base + ".ttgir", "w").write(k.asm["ttgir"])
        open(base + ".cubin", "wb").write(k.asm["cubin"])


BMAX = gw.BLOCK_M_CHOICES[-1]
configs = [(fmt, ws, dgrad, gw.DECODE_WARPS, BMAX, gw.BN) for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16"))
           for dgrad in (0, 1)]
configs += [(MXFP4, "u8", dgrad, 8, BMAX, gw.BN) for dgrad in (0, 1)]  # the 8-warp decode partition too
configs += [(fmt, ws, dgrad, gw.DECODE_WARPS, bm, gw.BN) for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16"))
            for dgrad in (0, 1) for bm in gw.BLOCK_M_CHOICES[:-1]]  # fewer rows per tile (few tokens per expert)
configs += [(fmt, ws, dgrad, 4, bm, 256) for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16")) for dgrad in (0, 1)
            for bm in (BMAX, 16)]  # 256-column tiles: two wgmma warpgroups (4 decode warps: 8 spill)
for fmt, ws, dgrad, warps, bm, bn in configs:
    stages = gw.default_load_stages(bm, dgrad, bn)
    k, ptx, usage = compile_w4a16(gw.w4a16_ws_kernel, dgrad, bm, bn, ws, {
        "FMT": fmt, "DGRAD": dgrad, "BM": bm, "BN": bn, "BK": gw.BK, "LOAD_STAGES": stages,
        "W_STAGES": gw.w_stages(bn), "DECODE_WARPS": warps, "DECODE_REGS": gw.decode_regs(warps, bn)},
        gw.consumer_warps(bn))
    print("w4a16_ws", "dgrad" if dgrad else "fwd", "mxfp4" if fmt == MXFP4 else "int4",
          f"BN {bn} decode warps {warps} BM {bm} load stages {stages}",
          "| wgmma:",
          "wgmma.mma_async" in ptx, "| TMA loads:", ptx.count("cp.async.bulk.tensor"), "| bf16x2 muls:",
          ptx.count("mul.rn.bf16x2"), "| shared bytes:", k.metadata.shared, "|", usage)
    if os.environ.get("GLUON_META"):
        print("  TMA metadata:", k.metadata.tensordesc_meta, "| warps:", k.metadata.num_warps)
    dump(k, f"{'dgrad' if dgrad else 'fwd'}_{fmt}_n{bn}_w{warps}_m{bm}")

# the forward with the decoded weights in the wgmma's register A fragment (kimi_core.kernels.gluon_w4a16_rs); "K loop
# SASS": the instructions of the innermost loop issuing wgmmas (sm90_cubin.mma_loop; decode ahead: two K steps)
from kimi_core.kernels import gluon_w4a16_rs as rs  # noqa: E402

for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16")):
    # (columns, rows, wgmmas per K step, programs per SM, decode ahead)
    for bn, bm, chunks, ctas, ahead in (
            (256, BMAX, 1, 1, 0), (256, 16, 1, 1, 0), (128, 256, 1, 1, 0), (128, BMAX, 1, 1, 0), (128, 16, 1, 1, 0),
            (128, 256, 2, 1, 0), (128, 256, 4, 1, 0), (256, BMAX, 4, 1, 0), (128, 16, 4, 1, 0), (128, 16, 4, 2, 0),
            (128, 64, 2, 2, 0), (256, 32, 1, 2, 0), (256, 16, 4, 2, 0),
            (128, 256, 1, 1, 1), (128, BMAX, 1, 1, 1), (128, 16, 1, 1, 1), (128, 64, 1, 2, 1)):
        stages = rs.default_load_stages(bm, bn, ctas)
        two = rs.TWO_PER_SM
        k, ptx, usage = compile_w4a16(rs.w4a16_rs_kernel, 0, bm, bn, ws, {
            "FMT": fmt, "BM": bm, "BN": bn, "BK": gw.BK, "LOAD_STAGES": stages,
            "CONSUMER_REGS": rs.CONSUMER_REGS if ctas == 1 else two["consumer_regs"], "MMA_CHUNKS": chunks,
            "DECODE_AHEAD": ahead, "DGRAD": False}, 4, None if ctas == 1 else two["maxnreg"])
        if ctas == 2:  # two programs must fit one SM: registers at launch and shared memory
            assert 2 * 384 * int(re.search(r"REG:(\d+)", usage).group(1)) <= 65536 and k.metadata.shared <= 113 * 1024
        print("w4a16_rs fwd", "mxfp4" if fmt == MXFP4 else "int4", f"BN {bn} BM {bm} load stages {stages}",
              f"wgmmas per K step {chunks} programs per SM {ctas} decode ahead {ahead}",
              "| wgmma with register A:", assert_register_wgmma(ptx), "| shared bytes:", k.metadata.shared, "|",
              usage, "| K loop SASS:", mma_loop(k.asm["cubin"])[0])
        dump(k, f"rs_{fmt}_n{bn}_m{bm}_c{chunks}_o{ctas}_a{ahead}")

# the dgrad with the decoded weights in the register A fragment (rows reordered, transposed scales)
for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16")):
    for bn, bm, ahead in ((256, BMAX, 0), (256, 16, 0), (128, 256, 0), (128, BMAX, 0), (128, 16, 0), (128, 256, 1),
                          (128, 16, 1)):
        stages = rs.default_load_stages(bm, bn, dgrad=True)
        k, ptx, usage = compile_w4a16(rs.w4a16_rs_kernel, 1, bm, bn, ws, {
            "FMT": fmt, "BM": bm, "BN": bn, "BK": gw.BK, "LOAD_STAGES": stages, "CONSUMER_REGS": rs.CONSUMER_REGS,
            "MMA_CHUNKS": 1, "DECODE_AHEAD": ahead, "DGRAD": True}, 4, scales_t=True)
        print("w4a16_rs dgrad", "mxfp4" if fmt == MXFP4 else "int4", f"BN {bn} BM {bm} load stages {stages}",
              f"decode ahead {ahead}", "| wgmma with register A:", assert_register_wgmma(ptx), "| shared bytes:",
              k.metadata.shared, "|", usage, "| K loop SASS:", mma_loop(k.asm["cubin"])[0], flush=True)
        dump(k, f"rs_dgrad_{fmt}_n{bn}_m{bm}_a{ahead}")

# MXFP4 with the 2^126 folded into the scales (one multiply per decoded pair; gw.FMT_MXFP4_FOLDED), forward and dgrad
for dgrad, bn, bm, ahead in ((0, 128, 256, 1), (0, 256, BMAX, 0), (1, 128, 256, 1), (1, 256, BMAX, 0)):
    stages = rs.default_load_stages(bm, bn, dgrad=bool(dgrad))
    k, ptx, usage = compile_w4a16(rs.w4a16_rs_kernel, dgrad, bm, bn, "u8", {
        "FMT": gw.FMT_MXFP4_FOLDED, "BM": bm, "BN": bn, "BK": gw.BK, "LOAD_STAGES": stages,
        "CONSUMER_REGS": rs.CONSUMER_REGS, "MMA_CHUNKS": 1, "DECODE_AHEAD": ahead, "DGRAD": bool(dgrad)}, 4,
        scales_t=bool(dgrad))
    print("w4a16_rs", "dgrad" if dgrad else "fwd", "mxfp4 folded", f"BN {bn} BM {bm} decode ahead {ahead}",
          "| wgmma with register A:", assert_register_wgmma(ptx), "| bf16x2 muls:", ptx.count("mul.rn.bf16x2"),
          "| shared bytes:", k.metadata.shared, "|", usage, flush=True)
    dump(k, f"rs_{'dgrad' if dgrad else 'fwd'}_folded_n{bn}_m{bm}_a{ahead}")
