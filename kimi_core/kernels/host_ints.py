"""Rows per expert (``m_splits``) read on the host, and the small integer tables built from them (expert offsets,
tile tables) moved to the kernels' device, cached per split pattern.

A CUDA copy from ordinary (pageable) host memory holds the host until the GPU has finished every kernel queued before
it, a hidden device sync per call (docs/performance.md#w4a16-grouped-gemm). From pinned memory the copy is queued
like a kernel and the host runs on; the caching host allocator keeps the pinned buffer until the copy has run.

A MoE layer runs its grouped GEMMs several times on one split pattern (gate, up and down in the forward, again in an
activation recompute and in the dgrad), so each table is built and copied once per pattern and device
(:class:`SplitPattern`, :func:`split_pattern`): a later call pays a tuple and a dictionary lookup. A CUDA tensor of
splits is never read here (the callers build what they need on the device, no sync).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import torch

__all__ = ["CACHED_PATTERNS", "SplitPattern", "host_offsets", "int32_on", "split_pattern"]

#: split patterns (with their device tables) kept, least recently used dropped first
CACHED_PATTERNS = 256


def host_offsets(m_splits) -> list[int]:
    """``[0, m_0, m_0 + m_1, ..., T]`` (``E + 1`` ints) of ``m_splits`` (a list of ints or an integer tensor; a CUDA
    tensor is read back, a device-to-host sync)."""
    if isinstance(m_splits, SplitPattern):
        return list(m_splits.offsets)
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits
    off = [0]
    for v in splits:
        off.append(off[-1] + int(v))
    return off


def int32_on(values, device) -> torch.Tensor:
    """``values`` (a list of ints, or of equal-length tuples of ints, or a CPU integer tensor) as an int32 tensor on
    ``device``: ``[n]`` or ``[n, width]``; a CUDA device gets it without the host waiting for the GPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        table = values.to(torch.int32)
        table = table.pin_memory() if cuda else table
    else:
        table = torch.tensor(values, dtype=torch.int32, pin_memory=cuda)
    return table.to(device, non_blocking=True) if cuda else table.to(device)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitPattern(tuple):
    """``E`` rows per expert as a tuple of ints (usable wherever a list of splits is), with ``offsets`` (``E + 1``
    ints, :func:`host_offsets`), ``total`` rows and the tables built from them, kept per key (:meth:`table`)."""

    def __new__(cls, splits):
        self = super().__new__(cls, splits)
        self.offsets = tuple(itertools.accumulate(self, initial=0))
        self.total = self.offsets[-1]
        self._tables = {}
        return self

    def table(self, key, build, device=None):
        """The table ``key`` of this pattern: ``build()`` on first use, then the same object. ``device`` (where the
        table lives): while a CUDA graph is being captured there, a new table is not kept (its memory and its copy
        belong to the graph)."""
        found = self._tables.get(key)
        if found is None:
            found = build()
            if device is None or not _capturing(torch.device(device)):
                self._tables[key] = found
        return found

    def device_offsets(self, device) -> torch.Tensor:
        """int32 ``[E + 1]`` :attr:`offsets` on ``device`` (a CUDA device with its index)."""
        device = torch.device(device)
        return self.table(("offsets", device), lambda: int32_on(list(self.offsets), device), device)

    def row_tiles(self, block_m: int) -> int:
        """Row tiles of ``block_m`` over all experts: ``sum(ceil(m_e / block_m))``."""
        return self.table(("row_tiles", block_m), lambda: sum((v + block_m - 1) // block_m for v in self))

    def busy_mean(self) -> float:
        """Mean rows of the non-empty experts (0 when every expert is empty)."""

        def mean() -> float:
            busy = sum(1 for v in self if v)
            return self.total / busy if busy else 0.0

        return self.table("busy_mean", mean)


_PATTERNS: OrderedDict[tuple, SplitPattern] = OrderedDict()
_BY_BYTES: OrderedDict[tuple, SplitPattern] = OrderedDict()  # CPU tensors: (dtype, raw bytes) -> pattern
_PATTERNS_LOCK = threading.Lock()


def _remember(cache: OrderedDict, key, pattern: SplitPattern) -> None:
    cache[key] = pattern
    cache.move_to_end(key)
    if len(cache) > CACHED_PATTERNS:
        cache.popitem(last=False)


def _pattern_of_ints(key: tuple) -> SplitPattern:
    """The kept pattern equal to ``key`` (a tuple of ints or of anything whose ``int`` is the count), else a new
    one."""
    found = _PATTERNS.get(key)
    if found is None:
        ints = tuple(map(int, key))
        found = _PATTERNS.get(ints) or SplitPattern(ints)
        _remember(_PATTERNS, ints, found)
    else:
        _PATTERNS.move_to_end(key)
    return found


def split_pattern(m_splits) -> SplitPattern | None:
    """The :class:`SplitPattern` of ``m_splits`` (a list / tuple of ints, a CPU integer tensor, or a
    :class:`SplitPattern`, returned as it is); None for a tensor on another device (never read back here). The last
    :data:`CACHED_PATTERNS` patterns are kept, so their tables are built once; a list is looked up by its tuple and a
    CPU tensor by its bytes, without converting each count."""
    if isinstance(m_splits, SplitPattern):
        return m_splits
    with _PATTERNS_LOCK:
        if isinstance(m_splits, torch.Tensor):
            if m_splits.device.type != "cpu":
                return None
            key = (m_splits.dtype, m_splits.contiguous().numpy().tobytes())
            found = _BY_BYTES.get(key)
            if found is None:
                found = _pattern_of_ints(tuple(m_splits.tolist()))
            _remember(_BY_BYTES, key, found)
            return found
        return _pattern_of_ints(tuple(m_splits))
