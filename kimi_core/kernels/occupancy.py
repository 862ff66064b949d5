"""Programs of a compiled Triton kernel that one streaming multiprocessor holds at once, as the CUDA driver counts them.

A launcher that balances its last wave of programs (:func:`kimi_core.kernels.w4a16.fused.plans.tail_pieces`) needs the
number of programs resident per SM. That number follows from the compiled kernel's registers, shared memory and warps
by the hardware's allocation rules; rather than restate those rules, this asks the driver
(``cuOccupancyMaxActiveBlocksPerMultiprocessor``) for the kernel Triton loaded, with the block size and dynamic shared
memory Triton launches it with.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _occupancy_query():
    """``cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, CUfunction f, int block_size, size_t dyn_smem)``
    from the driver library (present wherever a CUDA device runs)."""
    fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def resident_programs(compiled) -> int:
    """Programs of ``compiled`` (a Triton ``CompiledKernel``, e.g. from ``kernel.warmup(...)``) resident at once on one
    SM of the current device: ``num_warps * 32`` threads each, ``metadata.shared`` bytes of dynamic shared memory.
    Raises ``RuntimeError`` naming the kernel and the driver's ``CUresult`` if the query fails."""
    _ = compiled.run  # loads the binary on the current device: compiled.function is its CUfunction from here on
    blocks = ctypes.c_int(0)
    err = _occupancy_query()(
        ctypes.byref(blocks),
        ctypes.c_void_p(compiled.function),
        compiled.metadata.num_warps * 32,
        compiled.metadata.shared,
    )
    if err != 0:
        raise RuntimeError(
            f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed for Triton kernel {compiled.name} (CUresult {err})"
        )
    return blocks.value
