"""Facts about the device a kernel runs on: compute capability, streaming multiprocessors, the Triton interpreter.

Read once per device and cached, so the dispatcher asks them on every call for free.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["capability", "device_capability", "interpreting", "sm_count"]


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """:func:`capability` of a CUDA ``device`` (no index: the current device)."""
    return capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a CPU run under the interpreter: 1, so nothing splits)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``: kernels on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
