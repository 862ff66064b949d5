"""Compile the Gluon W4A16 register kernels (:mod:`kimi_core.kernels.w4a16.gluon`) for Hopper (sm_90a) on a CPU
machine, with the ``ptxas`` and ``cuobjdump`` Triton's wheel bundles: no GPU needed.

First a one-tile bf16 wgmma (``wgmma.mma_async`` must appear in the PTX for ``.target sm_90a``), then every
compiled variant of the register kernels, forward and dgrad, both formats and the folded MXFP4 decode: each must
fit one block's 227 KB of shared memory without spills, take its wgmma A operand from registers, and have no wgmma
serialized by ptxas (C7510-C7519). Prints registers, shared bytes and the K loop's SASS instruction count.

    python tools/kernels/gluon_sm90_compile_check.py    # from the project root, with the GPU's Triton installed
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


src = GluonASTSource(
    tile_mma,
    {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
    constexprs={"BM": 64, "BN": 64, "BK": 64},
)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = k.asm["ptx"]
targets = [line for line in ptx.splitlines() if line.startswith(".target")]
print(
    "triton",
    triton.__version__,
    "| wgmma in PTX:",
    "wgmma.mma_async" in ptx,
    "| .target",
    targets,
    "| cubin bytes",
    len(k.asm["cubin"]),
)

# the W4A16 register kernels, forward and dgrad, both formats (needs torch importable, as kimi_core.kernels is; run
# from the project root)
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_cubin import mma_loop, resource_usage  # noqa: E402

from kimi_core.kernels.w4a16.format_ids import FMT_INT4 as INT4  # noqa: E402
from kimi_core.kernels.w4a16.format_ids import FMT_MXFP4 as MXFP4  # noqa: E402
from kimi_core.kernels.w4a16.format_ids import FMT_MXFP4_FOLDED  # noqa: E402
from kimi_core.kernels.w4a16.gluon import launch, tiles  # noqa: E402
from kimi_core.kernels.w4a16.gluon.register_kernel import w4a16_rs_kernel  # noqa: E402


def desc_sig(dtype: str, block: list[int], gl_dtype, layout=None) -> str:
    """The launcher's signature string of a host TensorDescriptor argument (``tensordesc<dtype[block],layout>``;
    ``layout``: default swizzle unless given)."""
    layout = layout or gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def compile_w4a16(dgrad: int, bm: int, bn: int, ws: str, constexprs: dict):
    """Compile one register-kernel variant for sm_90a (its launcher's signature: the three TMA descriptors of
    :func:`launch.descriptor_blocks`, the output / tile-table pointers and the int arguments, then ``constexprs``);
    asserts it fits one block (<= 227 KB shared) without spills. Returns ``(compiled, ptx, resource usage)``."""
    scale_bytes = 1 if ws == "u8" else 2
    a_block, p_block, s_block = launch.descriptor_blocks(bool(dgrad), bm, scale_bytes, bn)
    sig = {
        "a_desc": desc_sig("bf16", a_block, gl.bfloat16),
        "p_desc": desc_sig("u8", p_block, gl.uint8),
        "s_desc": desc_sig(ws, s_block, None, launch.scale_smem_layout(s_block, scale_bytes, bool(dgrad))),
        "out_ptr": "*bf16",
        "tiles_ptr": "*i32",
        "n_tiles": "i32",
        "n_col_tiles": "i32",
        "N": "i32",
        "K": "i32",
        "stride_om": "i32",
        **{n: "constexpr" for n in constexprs},
    }
    k = triton.compile(
        GluonASTSource(w4a16_rs_kernel, sig, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    usage = resource_usage(k.asm["cubin"])
    assert k.metadata.shared <= 227 * 1024, f"{k.metadata.shared} B of shared memory: over 227 KB a block"
    assert " LOCAL:0" in usage and " STACK:0" in usage, f"spills: {usage}"
    return k, k.asm["ptx"], usage


def wgmma_serialization_warnings(ptx: str) -> list[str]:
    """ptxas's (Triton's wheel) warnings that it serialized wgmmas (``C7510``-``C7519``, e.g. C7513: a non-wgmma
    instruction defines a register that an in-flight wgmma reads), from re-assembling ``ptx`` for sm_90a; Triton's
    own ptxas run does not show them."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [tool, "-arch=sm_90a", "-o", os.path.join(tmp, "k.cubin"), src], capture_output=True, text=True
        )
    assert done.returncode == 0, f"ptxas failed: {done.stderr[-2000:]}"
    return [line for line in done.stderr.splitlines() if re.search(r"C751\d", line)]


def assert_register_wgmma(ptx: str) -> bool:
    """The kernel's wgmmas take A from registers (a register list ``{%r..}``, not a shared-memory descriptor) and
    ptxas serializes none of them; returns True for the printout."""
    rs_form = any("wgmma.mma_async" in line and ", {%r" in line for line in ptx.splitlines())
    assert rs_form, "the register kernel's wgmma must take A from registers"
    serialized = wgmma_serialization_warnings(ptx)
    assert not serialized, f"ptxas serializes the wgmmas of this variant: {serialized}"
    return rs_form


def dump(k, name: str) -> None:
    """``GLUON_DUMP=<prefix>``: write the variant's PTX, TTGIR and cubin beside ``<prefix>_<name>``."""
    if os.environ.get("GLUON_DUMP"):
        base = f"{os.environ['GLUON_DUMP']}_{name}"
        for ext, key, mode in ((".ptx", "ptx", "w"), (".ttgir", "ttgir", "w"), (".cubin", "cubin", "wb")):
            with open(base + ext, mode) as f:
                f.write(k.asm[key])


BMAX = tiles.BM
# (format id, scale dtype, dgrad, columns, rows, decode ahead); "K loop SASS": the instructions of the innermost loop
# issuing wgmmas (sm90_cubin.mma_loop; decode ahead: two K steps)
VARIANTS = [
    (fmt, ws, 0, bn, bm, ahead)
    for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16"))
    for bn, bm, ahead in (
        (256, BMAX, 0),
        (256, 16, 0),
        (128, 256, 0),
        (128, BMAX, 0),
        (128, 16, 0),
        (128, 256, 1),
        (128, BMAX, 1),
        (128, 16, 1),
    )
]
VARIANTS += [
    (fmt, ws, 1, bn, bm, ahead)
    for fmt, ws in ((MXFP4, "u8"), (INT4, "bf16"))
    for bn, bm, ahead in (
        (256, BMAX, 0),
        (256, 16, 0),
        (128, 256, 0),
        (128, BMAX, 0),
        (128, 16, 0),
        (128, 256, 1),
        (128, 16, 1),
    )
]
# MXFP4 with the 2^126 folded into the scales (one multiply per decoded pair)
VARIANTS += [
    (FMT_MXFP4_FOLDED, "u8", dgrad, bn, bm, ahead)
    for dgrad, bn, bm, ahead in ((0, 128, 256, 1), (0, 256, BMAX, 0), (1, 128, 256, 1), (1, 256, BMAX, 0))
]
NAMES = {MXFP4: "mxfp4", INT4: "int4", FMT_MXFP4_FOLDED: "mxfp4 folded"}
for fmt, ws, dgrad, bn, bm, ahead in VARIANTS:
    stages = tiles.default_load_stages(bm, bn, dgrad=bool(dgrad))
    k, ptx, usage = compile_w4a16(
        dgrad,
        bm,
        bn,
        ws,
        {
            "FMT": fmt,
            "BM": bm,
            "BN": bn,
            "BK": tiles.BK,
            "LOAD_STAGES": stages,
            "CONSUMER_REGS": tiles.CONSUMER_REGS,
            "DECODE_AHEAD": bool(ahead),
            "DGRAD": bool(dgrad),
        },
    )
    print(
        "w4a16_rs",
        "dgrad" if dgrad else "fwd",
        NAMES[fmt],
        f"BN {bn} BM {bm} load stages {stages}",
        f"decode ahead {ahead}",
        "| wgmma with register A:",
        assert_register_wgmma(ptx),
        "| bf16x2 muls:",
        ptx.count("mul.rn.bf16x2"),
        "| shared bytes:",
        k.metadata.shared,
        "|",
        usage,
        "| K loop SASS:",
        mma_loop(k.asm["cubin"])[0],
        flush=True,
    )
    dump(k, f"rs_{'dgrad' if dgrad else 'fwd'}_{fmt}_n{bn}_m{bm}_a{ahead}")
