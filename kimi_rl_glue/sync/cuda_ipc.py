"""Adapter sync over CUDA IPC (the SGLang transport, miles' colocated weight sync): trainer GPU buckets
opened, copied and checked by an engine process.

Trainer: :func:`kimi_core.sync.version_layout.flatten_version` flattens version ``k`` of the adapter into
:func:`kimi_core.sync.iter_buckets` buckets on the trainer's GPU in one gather launch, writing each bucket's
``int64`` block sums (:mod:`kimi_core.sync.checksum`) right after its bytes in the same allocation, so one
IPC handle carries both. It publishes a *manifest*: the version, the PEFT ``adapter_config`` and one
CUDA-IPC handle per bucket (``torch.multiprocessing.reductions.reduce_tensor``), pickled, plus the bucket
metadata (:class:`~kimi_core.sync.version_layout.VersionLayout`'s blob, built once per run), framed by
lengths and the :func:`~kimi_core.sync.checksum.digest` of each part. The manifest travels by any channel
(a pipe, ZMQ, HTTP) to the engine process.

Engine: checks the frame, refuses another version than the one asked for, opens the handles and copies
each bucket into its own receive buffers while the block-sum kernel sums every block and compares it with
the sender's, raising a device flag: colocated, one launch for the whole version; from another GPU, the
copy engine moves each bucket (bytes and sums) on a side stream and the SMs check the bucket before it.
It synchronises once per version; on a mismatch it names the first bad block's tensor and raises
:class:`~kimi_core.sync.AdapterSyncError`. The returned tensors are views into the receive buffers.

Expert sharding: ``publish(..., experts=(lo, hi))`` sends a consumer rank only those experts' rows
(:func:`kimi_core.sync.filter_experts`); publish once per consumer rank with its range.

Lifetime: the trainer keeps each version's buckets alive until :meth:`CudaIpcAdapterSync.release` (call
it when the engine has acknowledged the version). Buffers persist: a version published while none is in
flight reuses the trainer's bucket buffers (same IPC handles), and the engine keeps the last version's
mappings open, so each handle is opened once per run. The engine receives into two alternating sets of
buffers, never the set holding the last good version, so a rejected version leaves that one intact. The
manifest is a pickle that only a trusted process on the same node should produce (as SGLang's serialized
handles); its digests catch a truncated or damaged manifest before unpickling.

Timings (seconds): ``publish`` returns ``flatten_s``, ``flatten_gpu_s``, ``gather_gpu_s``, ``share_s``;
``receive`` puts ``open_s``, ``copy_s``, ``verify_s``, ``copy_gpu_s`` and, colocated, ``launch_gpu_s`` into
``adapter.extra["sync_timings"]``. ``checksum=False`` turns the sums and digests off on both sides (the
same kernels then only copy), to measure their cost (``benchmarks/adapter_sync.py cuda-ipc``).
"""

from __future__ import annotations

import pickle
import struct
import time

import torch

from kimi_core.kernels.block_sums import copy_sum_blocks
from kimi_core.lora import Adapter
from kimi_core.sync import AdapterSyncError, Bucket, BucketChecksumError, assemble
from kimi_core.sync.block_tables import version_table
from kimi_core.sync.checksum import BLOCK_WORDS, copy_block_sums, digest, n_blocks
from kimi_core.sync.version_layout import VersionLayout, flatten_version

__all__ = ["CudaIpcAdapterSync", "FRAME"]

#: manifest = FRAME + body (pickle: version, adapter config, handles) + layout blob (bucket metadata);
#: FRAME: body length, its digest, blob length, its digest, whether the digests are set
FRAME = struct.Struct("<Q16sQ16s?")
_UNSET = bytes(16)


def _frame(body: bytes, layout: VersionLayout, checked: bool) -> bytes:
    """The manifest; the layout blob's digest is computed once per layout (cached), not per step."""
    blob = layout.blob
    return (
        FRAME.pack(
            len(body),
            digest(body) if checked else _UNSET,
            len(blob),
            layout.blob_digest if checked else _UNSET,
            checked,
        )
        + body
        + blob
    )


def _unframe(manifest: bytes, version: int, known_blob: bytes | None) -> tuple[bytes, bytes, bool]:
    """``(body, blob, whether blob == known_blob)`` of a manifest; raises :class:`AdapterSyncError` if a
    length or digest disagrees. A blob equal to ``known_blob`` (an earlier checked one) is not hashed again."""
    if len(manifest) >= FRAME.size:
        n, body_digest, m, blob_digest, checked = FRAME.unpack_from(manifest)
        body, blob = manifest[FRAME.size : FRAME.size + n], manifest[FRAME.size + n :]
        known = blob == known_blob
        if (
            len(body) == n
            and len(blob) == m
            and (not checked or (digest(body) == body_digest and (known or digest(blob) == blob_digest)))
        ):
            return body, blob, known
    raise AdapterSyncError(
        f"CUDA IPC: manifest of adapter version {version} fails its length + digest check (truncated or altered)"
    )


class CudaIpcAdapterSync:
    """:param device: this side's GPU (the trainer's for ``publish``, the engine's for ``receive``);
    :param bucket_bytes: size of one bucket; :param checksum: compute and check the sums."""

    def __init__(
        self, device: torch.device | str | int | None = None, bucket_bytes: int = 256 << 20, checksum: bool = True
    ):
        if not torch.cuda.is_available():
            raise AdapterSyncError("CudaIpcAdapterSync needs a CUDA device; on CPUs use DiskAdapterSync")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self._live: dict[int, list[Bucket]] = {}  # published, not released
        self._pool: dict[int, torch.Tensor] = {}  # trainer: bucket index -> its wire buffer
        self._mapped: list[torch.Tensor] = []  # engine: the last version's opened buckets
        self._slots: tuple[dict, dict] = ({}, {})  # engine: two sets of receive buffers (and version sums)
        self._good: int | None = None  # engine: the slot holding the last good version
        self._layout: tuple[bytes, list] | None = None  # engine: the last layout blob, parsed

    # ------------------------------------------------------------------ trainer side
    def publish(
        self, adapter: Adapter, version: int, *, experts: tuple[int, int] | None = None, config=None
    ) -> tuple[bytes, dict]:
        """Flatten ``adapter`` on this GPU as ``version``; returns ``(manifest, timings)``.

        :param experts: ``(lo, hi)``: only those experts' rows (needs ``config``, the model's
            :class:`~kimi_core.config.KimiConfig`).
        """
        from torch.multiprocessing.reductions import reduce_tensor

        if version in self._live:
            raise AdapterSyncError(
                f"CUDA IPC: adapter version {version} is already published; versions are never reused"
            )
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            start, end, k0, k1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            start.record()
            k0.record()  # (re-recorded around the gather launch, if any)
            k1.record()
            buckets, layout = flatten_version(
                adapter.tensors,
                self.bucket_bytes,
                device=self.device,
                block_sums=self.checksum,
                allocate=None if self._live else self._pooled_wire,
                config=config,
                experts=experts,
                events=(k0, k1),
            )
            end.record()
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            handles = [reduce_tensor(b.wire if self.checksum else b.buffer) for b in buckets]
        self._live[version] = buckets
        manifest = _frame(
            pickle.dumps(
                {
                    "version": version,
                    "adapter_config": adapter.adapter_config,
                    "checksum": self.checksum,
                    "handles": handles,
                }
            ),
            layout,
            self.checksum,
        )
        t2 = time.perf_counter()
        return manifest, {
            "publish_s": t2 - t0,
            "flatten_s": t1 - t0,
            "share_s": t2 - t1,
            "flatten_gpu_s": start.elapsed_time(end) / 1e3,
            "gather_gpu_s": k0.elapsed_time(k1) / 1e3,
            "bytes": sum(b.nbytes for b in buckets),
            "buckets": len(buckets),
        }

    def _pooled_wire(self, index: int, nbytes: int) -> torch.Tensor:
        return _pool_buffer(self._pool, index, nbytes, self.device)

    def release(self, version: int) -> None:
        """Free the trainer-side buckets of ``version`` (after the engine acknowledged it)."""
        self._live.pop(version, None)

    # ------------------------------------------------------------------ engine side
    def receive(self, version: int, manifest: bytes) -> Adapter:
        """Open, copy and check every bucket of ``manifest`` (what :meth:`publish` returned) on this GPU; raises
        :class:`AdapterSyncError` naming the version, bucket and tensor on any problem.

        The returned tensors are views into this receiver's buffers, valid until the second
        :meth:`receive` after this one (load them, as SGLang copies an adapter into its LoRA memory
        pool, before then); a rejected version never overwrites the last good one.
        """
        body, blob, known = _unframe(manifest, version, self._layout[0] if self._layout else None)
        try:
            man = pickle.loads(body)
        except Exception as e:  # noqa: BLE001 - unpickling corrupt bytes raises any type; reported as one error
            raise AdapterSyncError(f"CUDA IPC: manifest of adapter version {version} is corrupt: {e}") from None
        if man.get("version") != version:
            raise AdapterSyncError(
                f"CUDA IPC: manifest is for adapter version {man.get('version')}, expected {version} (stale adapter)"
            )
        if not known:  # a new bucket layout: parse it once
            try:
                self._layout = (blob, [_parse_bucket(m) for m in pickle.loads(blob)])
            except Exception as e:  # noqa: BLE001 - unpickling corrupt bytes raises any type; reported as one error
                raise AdapterSyncError(
                    f"CUDA IPC: bucket layout of adapter version {version} is corrupt: {e}"
                ) from None
        parsed = self._layout[1]
        check = bool(man["checksum"])
        k = 1 if self._good == 0 else 0
        slot = self._slots[k]  # never the buffers of the last good version
        buckets, local, opened, pending, t_open, t_copy = [], [], [], [], 0.0, 0.0
        with torch.cuda.device(self.device):
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream(self.device)  # cross-GPU copies, ahead of the checks on `main`
            src_side: dict[torch.device, torch.cuda.Stream] = {}
            bad = torch.zeros((), dtype=torch.int32, device=self.device)
            start, end, k0, k1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            start.record()
            side.wait_stream(main)
            try:
                if len(man["handles"]) != len(parsed):
                    raise AdapterSyncError(
                        f"CUDA IPC: manifest of adapter version {version} has {len(man['handles'])} "
                        f"bucket handles for {len(parsed)} buckets"
                    )
                for i, ((meta, n, starts, sums_bytes), (rebuild, args)) in enumerate(zip(parsed, man["handles"])):
                    ta = time.perf_counter()
                    src = rebuild(*args)  # the trainer's bucket (and its block sums), mapped into this process
                    opened.append(src)  # stays mapped until the copies have finished (finally below)
                    want = n + (sums_bytes if check else 0)
                    wire = _pool_buffer(slot, i, want, self.device)  # bytes, then the sender's sums
                    b = _slot_bucket(slot, i, wire[:n], meta)
                    if src.dtype != torch.uint8 or src.numel() != want:
                        raise AdapterSyncError(
                            f"CUDA IPC: bucket {b.index} of adapter version {version} has "
                            f"{src.numel()} {src.dtype} elements, manifest says {want} bytes"
                        )
                    buckets.append(b)
                    tb = time.perf_counter()
                    if src.device == self.device:  # colocated: one launch for the whole version, below
                        local.append((b, src, starts))
                    else:  # copy engine on `side`; sums + compare of this bucket on `main` after it
                        # torch runs a cross-GPU copy on the source GPU's current stream: not its default one
                        if src.device not in src_side:
                            src_side[src.device] = torch.cuda.Stream(src.device)
                        with torch.cuda.stream(src_side[src.device]), torch.cuda.stream(side):
                            wire.copy_(src, non_blocking=True)  # bytes and sums in one transfer
                        if check:
                            main.wait_stream(side)
                            sent = wire[n:].view(torch.int64)
                            got = copy_block_sums(b.buffer, None, starts, n, expect=sent, flag=bad)
                            pending.append((b, got, sent))
                    t_open += tb - ta
                    t_copy += time.perf_counter() - tb
                tb = time.perf_counter()
                if local:
                    k0.record()
                    pending += self._copy_version(slot, local, bad if check else None)
                    k1.record()
                main.wait_stream(side)
                end.record()
                t_copy += time.perf_counter() - tb
                tc = time.perf_counter()
                failed = bool(bad)  # the one synchronisation of this version
                if failed:
                    for b, got, sent in pending:
                        try:
                            b.check_blocks(got, sent)
                        except BucketChecksumError as e:
                            raise AdapterSyncError(f"CUDA IPC (adapter version {version}): {e}") from None
                    raise AdapterSyncError(f"CUDA IPC (adapter version {version}): block sums differ")  # unreachable
            finally:
                torch.cuda.synchronize(self.device)  # no copy may still read a mapping we close
                self._mapped = opened  # kept open: the trainer reuses its buffers (module doc)
            t_verify = time.perf_counter() - tc
        self._good = k
        cached = slot.get("views")  # the same bucket objects as last time in this slot: the same views
        if cached is None or len(cached[0]) != len(buckets) or any(a is not b for a, b in zip(cached[0], buckets)):
            cached = slot["views"] = (buckets, assemble(buckets, verify=False))
        tensors = dict(cached[1])
        return Adapter(
            tensors,
            man["adapter_config"],
            source=f"cuda_ipc:v{version}",
            extra={
                "sync_timings": {
                    "open_s": t_open,
                    "copy_s": t_copy,
                    "verify_s": t_verify,
                    "copy_gpu_s": start.elapsed_time(end) / 1e3,
                    "launch_gpu_s": k0.elapsed_time(k1) / 1e3 if local else None,
                    "bytes": sum(b.nbytes for b in buckets),
                }
            },
        )

    def _copy_version(
        self, slot: dict, local: list[tuple[Bucket, torch.Tensor, tuple[int, ...]]], flag: torch.Tensor | None
    ) -> list[tuple[Bucket, torch.Tensor, torch.Tensor]]:
        """Copy every same-GPU bucket into its receive buffer in one launch, summing and comparing with
        the sender's block sums (right after each bucket's bytes) when ``flag`` is given; returns
        ``(bucket, got sums, sent sums)`` per bucket for naming a mismatch. ``local``: per bucket
        ``(bucket, the sender's mapped wire buffer, region starts)``."""
        table, first, aligned = version_table(
            tuple(
                (src.data_ptr(), b.buffer.data_ptr(), src.data_ptr() + b.nbytes, starts, b.nbytes)
                for b, src, starts in local
            ),
            self.device,
        )
        if flag is None:
            copy_sum_blocks(table, BLOCK_WORDS, src_base=0, dst_base=0, aligned=aligned)
            return []
        sums = _pool_buffer(slot, "sums", 8 * first[-1], self.device).view(torch.int64)
        copy_sum_blocks(
            table,
            BLOCK_WORDS,
            src_base=0,
            dst_base=0,
            sums_base=sums.data_ptr(),
            expect_base=0,
            flag=flag,
            aligned=aligned,
        )
        return [
            (b, sums[first[k] : first[k + 1]], src[b.nbytes :].view(torch.int64)) for k, (b, src, _) in enumerate(local)
        ]


def _parse_bucket(meta: dict) -> tuple[dict, int, tuple[int, ...], int]:
    """``(metadata, nbytes, region starts, bytes of its block sums)`` of one bucket of a layout blob."""
    n = int(meta["nbytes"])
    starts = tuple(int(t[3]) for t in meta["tensors"])  # TensorMeta.to_list: offset at 3
    return meta, n, starts, 8 * n_blocks(starts, n)


def _slot_bucket(slot: dict, index: int, buffer: torch.Tensor, meta: dict) -> Bucket:
    """The receive slot's :class:`Bucket` ``index`` over ``buffer``, rebuilt only when the buffer or
    the metadata changed (tens of thousands of records per step otherwise, per-expert layout)."""
    key = ("bucket", index)
    cached = slot.get(key)
    if (
        cached is None
        or cached[0] is not meta
        or cached[1].buffer.data_ptr() != buffer.data_ptr()
        or cached[1].nbytes != buffer.numel()
    ):
        cached = slot[key] = (meta, Bucket.from_parts(buffer, meta, verify=False))
    return cached[1]


def _pool_buffer(pool: dict, key, nbytes: int, device: torch.device) -> torch.Tensor:
    """The persistent ``uint8 [nbytes]`` buffer ``pool[key]`` (replaced when the size changes)."""
    buf = pool.get(key)
    if buf is None or buf.numel() != nbytes:
        buf = pool[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf
