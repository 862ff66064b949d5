"""One adapter version flattened into GPU buckets in one launch, with its bucket layout built once per run.

An RL run syncs the same adapter shape at every step: the same names, dtypes and shapes in the same
order. :class:`VersionLayout` is everything that follows from those alone: which tensors share a
bucket, each tensor's :class:`~kimi_core.sync.buckets.TensorMeta`, each bucket's size, and the
buckets' metadata pickled once (:attr:`VersionLayout.blob`, with its digest) for a receiver. It is
cached by that signature, so with the per-expert layout (tens of thousands of tensors) no step
rebuilds thousands of metadata records on the trainer, and a receiver that keeps the last blob
parses it once (the CUDA-IPC transport).

:func:`flatten_version` then gathers every bucket whose tensors are contiguous and
:data:`~kimi_core.sync.checksum.ALIGN`-aligned on the device in one kernel launch (the block
table, absolute addresses, is cached too: parameters and persistent buckets keep their addresses),
with the block sums fused; any other bucket is concatenated on its own.
"""

from __future__ import annotations

import functools
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kimi_core.sync.block_tables import flatten_table, gather_addresses
from kimi_core.sync.buckets import (
    Bucket,
    TensorMeta,
    bucket_metadata,
    cat_into_bucket,
    filter_experts,
    group_spans,
    metas_of,
    wire_buffer,
)
from kimi_core.sync.checksum import BLOCK_WORDS, digest

__all__ = ["VersionLayout", "flatten_version", "version_layout"]


@dataclass(frozen=True, eq=False)
class VersionLayout:
    """The buckets of an adapter version, from its tensors' names, dtypes and shapes.

    :ivar spans: each bucket's index range into the version's tensors (in order).
    :ivar metas: each bucket's tensor records (offsets from the bucket start, ``sum`` 0).
    :ivar sizes: each bucket's bytes.
    :ivar expert_range: ``(lo, hi)`` when the version holds only those experts' rows.
    """

    spans: tuple[range, ...]
    metas: tuple[tuple[TensorMeta, ...], ...]
    sizes: tuple[int, ...]
    expert_range: tuple[int, int] | None

    @functools.cached_property
    def starts(self) -> tuple[tuple[int, ...], ...]:
        """Each bucket's region starts (byte offsets of its tensors)."""
        return tuple(tuple(m.offset for m in ms) for ms in self.metas)

    @functools.cached_property
    def blob(self) -> bytes:
        """Every bucket's :meth:`~kimi_core.sync.buckets.Bucket.metadata`, pickled (a list)."""
        return pickle.dumps(
            [bucket_metadata(i, n, "", self.expert_range, ms) for i, (n, ms) in enumerate(zip(self.sizes, self.metas))],
            protocol=5,
        )

    @functools.cached_property
    def blob_digest(self) -> bytes:
        """:func:`~kimi_core.sync.checksum.digest` of :attr:`blob`, computed once per layout."""
        return digest(self.blob)


def version_layout(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int, expert_range: tuple[int, int] | None = None
) -> VersionLayout:
    """The (cached) :class:`VersionLayout` of ``tensors`` in buckets of at most ``bucket_bytes``."""
    return _layout(
        tuple((name, t.dtype, t.shape) for name, t in tensors.items()),
        bucket_bytes,
        tuple(expert_range) if expert_range else None,
    )


@functools.lru_cache(maxsize=8)
def _layout(signature: tuple, bucket_bytes: int, expert_range) -> VersionLayout:
    spans = group_spans([math.prod(shape) * dtype.itemsize for _, dtype, shape in signature], bucket_bytes)
    per_bucket = [metas_of(signature[s.start : s.stop]) for s in spans]
    return VersionLayout(
        tuple(spans), tuple(tuple(ms) for ms, _ in per_bucket), tuple(n for _, n in per_bucket), expert_range
    )


def flatten_version(
    tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    *,
    device: torch.device,
    block_sums: bool = False,
    allocate=None,
    config=None,
    experts: tuple[int, int] | None = None,
    events: tuple | None = None,
) -> tuple[list[Bucket], VersionLayout]:
    """Every bucket of ``tensors`` on CUDA ``device``, as ``iter_buckets(..., checksum=False)`` gives
    them, with their block sums when ``block_sums``, and their layout.

    :param allocate: ``allocate(bucket_index, nbytes)`` returns a bucket's ``uint8`` buffer (bytes,
        then the block sums), e.g. persistent buffers reused at every step.
    :param config, experts: only experts ``[lo, hi)``'s rows (:func:`~kimi_core.sync.buckets.filter_experts`).
    :param events: two CUDA events recorded around the gather launch (its GPU time, without the host
        work before it).
    """
    from kimi_core.kernels.block_sums import copy_sum_blocks

    if experts is not None:
        if config is None:
            raise ValueError("flatten_version: experts=(lo, hi) needs config= to know the expert count")
        tensors = filter_experts(dict(tensors), config, *experts)
    layout = version_layout(tensors, bucket_bytes, experts)
    items = list(tensors.items())
    out, parts = [], []
    for index, (span, metas, off, starts) in enumerate(zip(layout.spans, layout.metas, layout.sizes, layout.starts)):
        group = items[span.start : span.stop]
        buf, wire = wire_buffer(index, off, starts, device, block_sums, allocate)
        out.append(Bucket(index, buf, list(metas), "", layout.expert_range, wire))
        addrs = gather_addresses([t for _, t in group], device)
        if addrs is None:
            cat_into_bucket(group, metas, buf, wire, starts, device)
        else:
            parts.append(
                (
                    addrs,
                    tuple(m.nbytes for m in metas),
                    starts,
                    off,
                    buf.data_ptr(),
                    wire[off:].data_ptr() if wire is not None else 0,
                )
            )
    if parts:
        table = flatten_table(tuple(parts), device)
        if events:
            events[0].record()
        copy_sum_blocks(table, BLOCK_WORDS, src_base=0, dst_base=0, sums_base=0 if block_sums else None, aligned=True)
        if events:
            events[1].record()
    return out, layout
