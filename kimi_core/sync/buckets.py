"""Stream an adapter as flat byte buckets with their checksums, optionally only some experts' rows.

A :class:`Bucket` is one contiguous ``uint8`` buffer plus a metadata list of
``(name, dtype, shape, offset, nbytes, sum)``: the flattened-bucket idea of SGLang's
``load_format="flattened_bucket"`` and miles' ``FlattenedTensorBucket`` (our own format). Every
tensor starts at a multiple of :data:`~kimi_core.sync.checksum.ALIGN` bytes; the gap after it is zero
and belongs to it, so each byte of the buffer is covered by exactly one tensor's sum. The sums and the
bucket's metadata digest are the scheme of :mod:`kimi_core.sync.checksum`.

Expert filtering (:func:`filter_experts`) gives a consumer rank only experts ``[lo, hi)``:
per-expert names outside the range are dropped, 3-D ``[E, ...]`` factors and the stacked
``[E*r, in]`` / ``[out, r*E]`` factors are sliced on their expert rows, shared ``[1, ...]``
factors and non-expert modules are kept. Names do not change; the range travels in the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kimi_core.sync.checksum import (
    ALIGN,
    copy_block_sums,
    first_bad_region,
    json_digest,
    n_blocks,
    region_sums,
)
from kimi_core.sync.errors import BucketChecksumError

__all__ = [
    "Bucket",
    "BucketChecksumError",
    "TensorMeta",
    "assemble",
    "bucket_metadata",
    "cat_into_bucket",
    "filter_experts",
    "group_spans",
    "iter_buckets",
    "metas_of",
    "wire_buffer",
]


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket buffer; ``sum`` is its region checksum (64-bit)."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sum: int = 0

    def to_list(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, f"{self.sum:016x}"]

    @classmethod
    def from_list(cls, x) -> TensorMeta:
        return cls(x[0], x[1], tuple(x[2]), int(x[3]), int(x[4]), int(x[5], 16))


def _digest(metas: list[TensorMeta], nbytes: int, expert_range) -> str:
    return json_digest({"nbytes": nbytes, "expert_range": expert_range, "tensors": [m.to_list() for m in metas]})


def bucket_metadata(index: int, nbytes: int, checksum: str, expert_range, metas) -> dict:
    """:meth:`Bucket.metadata` of a bucket with these fields (also without building the bucket)."""
    return {
        "index": index,
        "nbytes": nbytes,
        "checksum": checksum,
        "expert_range": list(expert_range) if expert_range else None,
        "tensors": [m.to_list() for m in metas],
    }


@dataclass
class Bucket:
    """One flattened bucket: ``buffer`` (``uint8 [nbytes]``) and ``metas`` in buffer order.

    :ivar checksum: BLAKE2b of the metadata (which includes every tensor's 64-bit sum).
    :ivar expert_range: ``(lo, hi)`` if the bucket holds only those experts' rows, else ``None``.
    :ivar wire: on a GPU with ``iter_buckets(block_sums=True)``: one allocation ``uint8 [nbytes +
        8 * n_blocks]`` holding ``buffer`` and then its ``int64`` block sums (:attr:`block_sums`),
        so a transport sends both under one handle.
    """

    index: int
    buffer: torch.Tensor
    metas: list[TensorMeta]
    checksum: str
    expert_range: tuple[int, int] | None = None
    wire: torch.Tensor | None = None

    @property
    def block_sums(self) -> torch.Tensor | None:
        """``int64 [n_blocks]`` block sums stored after the bytes in :attr:`wire` (else ``None``)."""
        return None if self.wire is None else self.wire[self.nbytes :].view(torch.int64)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` as views into ``buffer`` (no copy)."""
        out = {}
        for m in self.metas:
            dt = getattr(torch, m.dtype)
            out[m.name] = self.buffer[m.offset : m.offset + m.nbytes].view(dt).view(m.shape)
        return out

    def metadata(self) -> dict:
        """JSON-able description; :meth:`from_parts` rebuilds the bucket from it and the buffer."""
        return bucket_metadata(self.index, self.nbytes, self.checksum, self.expert_range, self.metas)

    @classmethod
    def from_parts(cls, buffer: torch.Tensor, metadata: dict, verify: bool = True) -> Bucket:
        """The receiving side: wrap a received buffer and its metadata; verifies by default."""
        rng = metadata.get("expert_range")
        b = cls(
            int(metadata["index"]),
            buffer,
            [TensorMeta.from_list(x) for x in metadata["tensors"]],
            metadata["checksum"],
            tuple(rng) if rng else None,
        )
        if buffer.dtype != torch.uint8 or buffer.ndim != 1 or buffer.numel() != int(metadata["nbytes"]):
            raise BucketChecksumError(
                f"bucket {b.index}: buffer must be uint8 [{metadata['nbytes']}], got "
                f"{buffer.dtype} {tuple(buffer.shape)}"
            )
        if verify:
            b.verify()
        return b

    def _metadata_digest(self) -> str:
        return _digest(self.metas, self.nbytes, list(self.expert_range) if self.expert_range else None)

    def seal(self) -> None:
        """Set :attr:`checksum` to the digest of the current metadata (names, shapes, offsets, sums)."""
        self.checksum = self._metadata_digest()

    def verify_metadata(self) -> None:
        """Check only the metadata digest (the block-sum transport checks the bytes separately)."""
        d = self._metadata_digest()
        if d != self.checksum:
            raise BucketChecksumError(
                f"bucket {self.index}: metadata checksum {d} != sent {self.checksum} "
                "(names, shapes, offsets or sums were altered)"
            )

    def check_blocks(self, got: torch.Tensor, sent: torch.Tensor) -> None:
        """Raise :class:`BucketChecksumError` naming the first tensor whose block sums differ."""
        i = first_bad_region(got, sent, self.region_starts(), self.nbytes)
        if i is not None:
            m = self.metas[i]
            raise BucketChecksumError(
                f"bucket {self.index}: tensor {m.name!r} (bytes {m.offset}..{m.offset + m.nbytes}) "
                "is corrupt: block sums differ from the sent ones"
            )

    def region_starts(self) -> list[int]:
        """Byte offset of every tensor region (the ``starts`` of :func:`region_sums`)."""
        return [m.offset for m in self.metas]

    def verify(self, sums: list[int] | None = None) -> None:
        """Check every tensor's sum and the metadata digest; raise :class:`BucketChecksumError`
        naming the bucket and the first tensor whose bytes changed.

        :param sums: the region sums if already computed on the way in (:func:`copy_region_sums`);
            otherwise they are recomputed from ``buffer`` (on its device).
        """
        got = sums if sums is not None else region_sums(self.buffer, self.region_starts(), self.nbytes)
        for m, s in zip(self.metas, got):
            if s != m.sum:
                raise BucketChecksumError(
                    f"bucket {self.index}: tensor {m.name!r} (bytes {m.offset}..{m.offset + m.nbytes}) is corrupt: "
                    f"checksum {s:016x} != sent {m.sum:016x}"
                )
        self.verify_metadata()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _metas(items: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Each tensor's place in a bucket (regions :data:`ALIGN`-aligned) and the bucket's size."""
    return metas_of([(name, t.dtype, tuple(t.shape)) for name, t in items])


def metas_of(signature) -> tuple[list[TensorMeta], int]:
    """:func:`_metas` from ``(name, torch dtype, shape)`` triples alone."""
    metas, off = [], 0
    for name, dtype, shape in signature:
        nb = math.prod(shape) * dtype.itemsize
        metas.append(TensorMeta(name, str(dtype).removeprefix("torch."), tuple(shape), off, nb))
        off += _align(nb)
    return metas, off


def wire_buffer(
    index: int, off: int, starts: list[int], device: torch.device, block_sums: bool, allocate
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GPU bucket's ``(buffer, wire)``: one allocation (from ``allocate`` when given) holding the
    ``off`` bytes and, with ``block_sums``, the block sums after them (``wire`` is ``None`` without)."""
    n = off + (8 * n_blocks(starts, off) if block_sums else 0)
    wire = allocate(index, n) if allocate else torch.empty(n, dtype=torch.uint8, device=device)
    if wire.dtype != torch.uint8 or wire.shape != (n,) or wire.device != device:
        raise ValueError(
            f"iter_buckets: allocate({index}, {n}) must return uint8 [{n}] on {device}, got "
            f"{wire.dtype} {tuple(wire.shape)} on {wire.device}"
        )
    return wire[:off], (wire if block_sums else None)


def cat_into_bucket(
    items: list[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    buf: torch.Tensor,
    wire: torch.Tensor | None,
    starts: list[int],
    device: torch.device,
) -> None:
    """Flatten ``items`` into the GPU bucket ``buf`` with one concatenation (tensors and their zero
    gaps; any device, layout or alignment), then its block sums into ``wire``'s tail when given."""
    cat, zeros = [], torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    for (_, t), m in zip(items, metas):
        cat.append(t.detach().to(device).contiguous().reshape(-1).view(torch.uint8))
        if _align(m.nbytes) > m.nbytes:
            cat.append(zeros[: _align(m.nbytes) - m.nbytes])
    torch.cat(cat, out=buf)
    if wire is not None:
        wire[buf.numel() :].view(torch.int64).copy_(copy_block_sums(buf, None, starts, buf.numel()))


def _flatten(
    index: int,
    items: list[tuple[str, torch.Tensor]],
    expert_range,
    checksum: bool,
    staging: list | None = None,
    device: torch.device | None = None,
    block_sums: bool = False,
    allocate=None,
) -> Bucket:
    metas, off = _metas(items)
    device = torch.device(device or "cpu")
    starts = [m.offset for m in metas]
    wire = None
    if block_sums or allocate:
        if device.type != "cuda" or staging is not None:
            raise ValueError("iter_buckets: block_sums=True or allocate= needs a CUDA device and no staging buffer")
        buf, wire = wire_buffer(index, off, starts, device, block_sums, allocate)
    elif staging is None:
        buf = torch.empty(off, dtype=torch.uint8, device=device)
    else:
        if staging[0] is None or staging[0].numel() < off:
            staging[0] = torch.empty(off, dtype=torch.uint8, device=device)
        buf = staging[0][:off]
    if device.type == "cpu":
        arr = buf.numpy()
        for (_, t), m in zip(items, metas):
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            # numpy's memcpy is ~4x faster than torch.copy_ for the many ~100 kB expert factors
            arr[m.offset : m.offset + m.nbytes] = src.contiguous().reshape(-1).view(torch.uint8).numpy()
            arr[m.offset + m.nbytes : _align(m.offset + m.nbytes)] = 0
    else:  # bucket by bucket; flatten_version gathers a whole version in one launch
        cat_into_bucket(items, metas, buf, wire, starts, device)
    if checksum:
        region = region_sums(buf, starts, off)
        metas = [TensorMeta(m.name, m.dtype, m.shape, m.offset, m.nbytes, s) for m, s in zip(metas, region)]
    bucket = Bucket(index, buf, metas, "", expert_range, wire)
    if checksum:
        bucket.seal()
    return bucket


def filter_experts(tensors: Mapping[str, torch.Tensor], config, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Only what a consumer owning experts ``[lo, hi)`` needs (see the module docstring).

    Sliced 3-D factors are views; sliced stacked ``lora_B`` is a copy (its experts are the
    fastest-varying column index).
    """
    from kimi_core.lora.naming import parse_lora_name  # here: kimi_core.lora re-exports this module

    E = config.n_routed_experts
    if not 0 <= lo < hi <= E:
        raise ValueError(f"filter_experts: expert range [{lo}, {hi}) is not inside [0, {E})")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        p = parse_lora_name(config, name)
        if p is None or p.form == "dense":
            out[name] = t
        elif p.form == "per_expert":
            if lo <= p.expert < hi:
                out[name] = t
        elif p.form == "expert_3d":
            if t.shape[0] == 1:
                out[name] = t
            elif t.shape[0] == E:
                out[name] = t[lo:hi]
            else:
                raise ValueError(f"filter_experts: {name!r} has {t.shape[0]} expert rows; expected {E} or 1")
        else:  # stacked
            if p.ab == "A":
                if t.shape[0] % E:
                    raise ValueError(f"filter_experts: {name!r} rows {t.shape[0]} are not a multiple of {E} experts")
                r = t.shape[0] // E
                out[name] = t[lo * r : hi * r]
            else:
                if t.shape[1] % E:
                    raise ValueError(f"filter_experts: {name!r} columns {t.shape[1]} are not a multiple of {E} experts")
                r = t.shape[1] // E
                out[name] = t.reshape(t.shape[0], r, E)[:, :, lo:hi].reshape(t.shape[0], r * (hi - lo))
    return out


def iter_buckets(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = 256 << 20,
    *,
    config=None,
    experts: tuple[int, int] | None = None,
    checksum: bool = True,
    reuse_buffer: bool = False,
    staging: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    block_sums: bool = False,
    allocate=None,
) -> Iterator[Bucket]:
    """Yield :class:`Bucket` s of at most ``bucket_bytes`` (a tensor larger than that gets a bucket
    of its own), in the order of ``tensors``.

    :param experts: ``(lo, hi)``: send only those experts' rows (needs ``config``).
    :param checksum: compute the sums (leave on; off only to measure their cost).
    :param reuse_buffer: flatten every bucket into one persistent staging buffer, so its pages
        are faulted in once (a fresh 256 MiB buffer per bucket costs more than the copy itself on
        CPU). The previous bucket's ``buffer`` is then overwritten when the iterator advances:
        send or copy it first.
    :param staging: a caller-owned ``uint8`` buffer to flatten into (implies ``reuse_buffer``;
        replaced by a larger one if a bucket does not fit), e.g. one kept across sync steps.
    :param device: where the buckets live (default the CPU); on CUDA the copies and the checksum
        stay on the GPU (the CUDA-IPC transport).
    :param block_sums: (CUDA) store each bucket's ``int64`` block sums after its bytes
        (:attr:`Bucket.wire`), one allocation, so a transport sends both under one handle.
    :param allocate: (CUDA) ``allocate(bucket_index, nbytes)`` returns the ``uint8 [nbytes]`` buffer
        of a bucket (with ``block_sums``: bytes and sums) instead of a fresh allocation, e.g. a
        transport's persistent buffers.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    if experts is not None:
        if config is None:
            raise ValueError("iter_buckets: experts=(lo, hi) needs config= to know the expert count")
        items = filter_experts(dict(items), config, *experts).items()
    device = torch.device(device or (staging.device if staging is not None else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if staging is not None and (staging.dtype != torch.uint8 or staging.ndim != 1 or staging.device != device):
        raise ValueError(f"iter_buckets: staging must be a 1-D uint8 tensor on {device}")
    stage: list | None = [staging] if staging is not None else ([None] if reuse_buffer else None)
    for index, group in enumerate(_groups(items, bucket_bytes)):
        yield _flatten(index, group, experts, checksum, stage, device, block_sums, allocate)


def _groups(items, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive ``(name, tensor)`` groups of at most ``bucket_bytes`` (a larger tensor alone)."""
    items = list(items)
    for span in group_spans([t.numel() * t.element_size() for _, t in items], bucket_bytes):
        yield items[span.start : span.stop]


def group_spans(nbytes: list[int], bucket_bytes: int) -> list[range]:
    """Index ranges of consecutive tensors of ``nbytes`` each that share a bucket of at most
    ``bucket_bytes`` (regions :data:`ALIGN`-aligned; a larger tensor gets a bucket alone)."""
    spans, first, size = [], 0, 0
    for i, nb in enumerate(nbytes):
        nb = _align(nb)
        if i > first and size + nb > bucket_bytes:
            spans.append(range(first, i))
            first, size = i, 0
        size += nb
    if len(nbytes) > first:
        spans.append(range(first, len(nbytes)))
    return spans


def assemble(buckets: Iterable[Bucket], verify: bool = True) -> dict[str, torch.Tensor]:
    """Receiver side: verify each bucket and merge their tensors (views into the buffers)."""
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        if verify:
            b.verify()
        for k, v in b.tensors().items():
            if k in out:
                raise BucketChecksumError(f"bucket {b.index}: tensor {k!r} was already received in an earlier bucket")
            out[k] = v
    return out
