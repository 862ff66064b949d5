"""Facts of an sm_90a cubin read with the cuobjdump in Triton's wheel (no GPU needed): registers, stack, local memory
(spills), and how many blocks of it an H100 / H200 SM holds by registers and by shared memory."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton

SM90_REGISTERS = 65536  # 32-bit registers per SM
SM90_SHARED = 228 * 1024  # shared memory per SM (227 KB usable by one block)
SM90_THREADS = 2048


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> str:
    """``REG:.. STACK:.. SHARED:.. LOCAL:..`` of a cubin (LOCAL > 0 or STACK > 0: spills)."""
    usage = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", _cuobjdump(cubin, "--dump-resource-usage"))
    return usage.group(0) if usage else "resource usage: ?"


def sass_instructions(cubin: bytes) -> int:
    """Number of SASS instructions in the cubin (all kernels)."""
    return sum(1 for line in _cuobjdump(cubin, "-sass").splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int) -> tuple[int, int]:
    """``(by registers, by shared memory and threads)``: resident blocks of a kernel with ``registers`` per thread
    (allocated in steps of 8), ``num_warps`` warps and ``shared_bytes`` of shared memory per block (+1 KB reserved)."""
    by_regs = SM90_REGISTERS // (-(-registers // 8) * 8 * 32 * num_warps)
    by_shared = SM90_SHARED // (shared_bytes + 1024) if shared_bytes else SM90_THREADS // (32 * num_warps)
    return by_regs, min(by_shared, SM90_THREADS // (32 * num_warps))


def mma_loop(cubin: bytes) -> tuple[int, dict[str, int]]:
    """``(instructions, {opcode: count})`` of the innermost loop that issues wgmmas (``HGMMA``): of the address ranges
    closed by a backward branch, the shortest holding an ``HGMMA`` (a K loop, its body as ptxas unrolled it; the
    register Gluon kernels under decode ahead hold two K steps). ``(0, {})`` where no loop issues one."""
    sass = _cuobjdump(cubin, "-sass")
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    best: list[str] = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < address and target in index:
            body = [t for _, t in code[index[target] : i + 1]]
            opcodes = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body]
            if "HGMMA" in opcodes and (not best or len(body) < len(best)):
                best = opcodes
    return len(best), dict(Counter(best).most_common())
