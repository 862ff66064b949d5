"""Small integer tables built on the host (expert offsets, tile tables) moved to the kernels' device.

A CUDA copy from ordinary (pageable) host memory holds the host until the GPU has finished every kernel queued before
it, a hidden device sync per call (docs/performance.md#w4a16-grouped-gemm). From pinned memory the copy is queued
like a kernel and the host runs on; the caching host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

import torch


def host_offsets(m_splits) -> list[int]:
    """``[0, m_0, m_0 + m_1, ..., T]`` (``E + 1`` ints) of ``m_splits`` (a list of ints or an integer tensor; a CUDA
    tensor is read back, a device-to-host sync)."""
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits
    off = [0]
    for v in splits:
        off.append(off[-1] + int(v))
    return off


def int32_on(values, device) -> torch.Tensor:
    """``values`` (a list of ints, or of equal-length tuples of ints) as an int32 tensor on ``device``: ``[n]`` or
    ``[n, width]``; a CUDA device gets it without the host waiting for the GPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    table = torch.tensor(values, dtype=torch.int32, pin_memory=cuda)
    return table.to(device, non_blocking=True) if cuda else table.to(device)
