"""Adapter-only sync through POSIX shared memory: the CPU stand-in for SGLang's CUDA-IPC buckets.

Same interface as :class:`~kimi_rl_glue.sync.disk.DiskAdapterSync`. The trainer publishes version
``k`` as one shared-memory segment per :func:`kimi_core.lora.iter_buckets` bucket
(``<channel>_v<k>_<i>``: the flat ``uint8`` buffer, each tensor with its 64-bit checksum) and then,
last, a manifest segment ``<channel>_v<k>_m`` (8-byte length, BLAKE2b of the JSON, the JSON: bucket
metadata, segment names, PEFT ``adapter_config``). The engine side opens the manifest, copies each
bucket out into its own memory, verifies the copy (so what is checked is what is returned) and
unlinks every segment of the version, on success and on error. A flipped byte raises
:class:`AdapterSyncError` naming the version, segment, bucket and tensor; the engine keeps the
previous adapter. Versions are never reused.

Ownership: the publisher hands its segments to the receiver (it unregisters them from Python's
``multiprocessing`` resource tracker, which would otherwise unlink them when the publishing process
exits); the receiver unlinks them. :meth:`ShmAdapterSync.discard` removes a version nobody received.
``receive(k)`` is meant to be called after ``publish(k)`` returned (the trainer tells the engine,
as miles does with SGLang); a manifest still being written reads as incomplete.

Timings: ``publish`` returns ``flatten_s`` (flatten + sender checksums), ``copy_s`` (into shared
memory); ``receive`` puts ``copy_s`` and ``verify_s`` into ``adapter.extra["sync_timings"]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kimi_core.lora import Adapter, Bucket, BucketChecksumError, assemble, iter_buckets
from kimi_rl_glue.sync.disk import AdapterSyncError

__all__ = ["ShmAdapterSync", "attach_segment"]

_HEAD = struct.Struct("<Q16s")  # JSON length, BLAKE2b-128 of the JSON


def _untrack(shm: shared_memory.SharedMemory) -> None:
    if sys.version_info < (3, 13):  # 3.13+ segments are opened with track=False instead
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the registered name


def _create(name: str, size: int, version: int) -> shared_memory.SharedMemory:
    kw = {"track": False} if sys.version_info >= (3, 13) else {}
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1), **kw)
    except FileExistsError:
        raise AdapterSyncError(f"shared memory {name}: adapter version {version} already exists; "
                               "versions are never reused") from None
    _untrack(shm)
    return shm


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without taking ownership (close it; do not unlink). For tools and tests."""
    kw = {"track": False} if sys.version_info >= (3, 13) else {}
    shm = shared_memory.SharedMemory(name=name, **kw)
    _untrack(shm)
    return shm


def _unlink(name: str) -> bool:
    """Remove a segment by name if it exists (the receiver owns it now)."""
    try:
        shm = shared_memory.SharedMemory(name=name)  # on < 3.13 this registers it; unlink() unregisters
    except FileNotFoundError:
        return False
    shm.close()
    shm.unlink()
    return True


class ShmAdapterSync:
    """:param channel: segment-name prefix shared by publisher and receiver (default: a fresh one;
    pass ``publisher.channel`` to the receiving process); :param bucket_bytes: size of one bucket."""

    def __init__(self, channel: str | None = None, bucket_bytes: int = 64 << 20):
        self.channel = channel or f"kimi_{os.getpid()}_{secrets.token_hex(3)}"
        self.bucket_bytes = bucket_bytes
        self._staging: torch.Tensor | None = None  # flatten buffer kept across versions (pages faulted once)

    def name(self, version: int, part: int | str = "m") -> str:
        """Segment name of bucket ``part`` of ``version`` (``"m"``: the manifest)."""
        return f"{self.channel}_v{version}_{part}"

    def publish(self, adapter: Adapter, version: int) -> tuple[str, dict]:
        """Put ``adapter`` into shared memory as ``version``; returns ``(manifest segment name, timings)``."""
        man_name = self.name(version)
        t0 = time.perf_counter()
        metas, made, t_flat, t_copy = [], [], 0.0, 0.0
        if self._staging is None:
            self._staging = torch.empty(self.bucket_bytes, dtype=torch.uint8)
        it = iter_buckets(adapter.tensors, self.bucket_bytes, staging=self._staging)
        try:
            while True:
                ta = time.perf_counter()
                b = next(it, None)
                tb = time.perf_counter()
                t_flat += tb - ta
                if b is None:
                    break
                seg = self.name(version, b.index)
                shm = _create(seg, b.nbytes, version)
                made.append(seg)
                view = np.frombuffer(shm.buf, dtype=np.uint8, count=b.nbytes)
                view[:] = b.buffer.numpy()
                del view
                shm.close()
                t_copy += time.perf_counter() - tb
                metas.append({**b.metadata(), "segment": seg})
            body = json.dumps({"version": version, "buckets": metas, "adapter_config": adapter.adapter_config}).encode()
            shm = _create(man_name, _HEAD.size + len(body), version)
            shm.buf[_HEAD.size:_HEAD.size + len(body)] = body
            shm.buf[:_HEAD.size] = _HEAD.pack(len(body), hashlib.blake2b(body, digest_size=16).digest())
            shm.close()
        except BaseException:
            for seg in made:
                _unlink(seg)
            raise
        return man_name, {"publish_s": time.perf_counter() - t0, "flatten_s": t_flat, "copy_s": t_copy,
                          "bytes": adapter.nbytes, "buckets": len(metas)}

    def _manifest(self, version: int) -> dict:
        man_name = self.name(version)
        try:
            shm = shared_memory.SharedMemory(name=man_name)
        except FileNotFoundError:
            raise AdapterSyncError(f"shared memory {man_name}: adapter version {version} was not published "
                                   "(or was already received)") from None
        try:
            n, digest = _HEAD.unpack(bytes(shm.buf[:_HEAD.size]))
            body = bytes(shm.buf[_HEAD.size:_HEAD.size + n]) if 0 < n <= shm.size - _HEAD.size else b""
        finally:
            shm.close()
            shm.unlink()
        if not body or hashlib.blake2b(body, digest_size=16).digest() != digest:
            raise AdapterSyncError(f"shared memory {man_name}: manifest of adapter version {version} is incomplete "
                                   "or corrupt (length or BLAKE2b mismatch)")
        return json.loads(body)

    def receive(self, version: int) -> Adapter:
        """Copy out, verify and unlink ``version``; raises :class:`AdapterSyncError` on any problem."""
        man = self._manifest(version)
        pending = [m["segment"] for m in man["buckets"]]
        buckets, t_copy, t_verify = [], 0.0, 0.0
        try:
            for meta in man["buckets"]:
                seg, n = meta["segment"], int(meta["nbytes"])
                ta = time.perf_counter()
                try:
                    shm = shared_memory.SharedMemory(name=seg)
                except FileNotFoundError:
                    raise AdapterSyncError(f"shared memory {seg}: bucket {meta['index']} of adapter version "
                                           f"{version} is missing") from None
                try:
                    if shm.size < n:
                        raise AdapterSyncError(f"shared memory {seg}: {shm.size} bytes, bucket {meta['index']} of "
                                               f"adapter version {version} needs {n}")
                    dst = torch.empty(n, dtype=torch.uint8)
                    src = np.frombuffer(shm.buf, dtype=np.uint8, count=n)
                    np.copyto(dst.numpy(), src)
                    del src
                finally:
                    shm.close()
                    shm.unlink()
                    pending.remove(seg)
                tb = time.perf_counter()
                try:
                    buckets.append(Bucket.from_parts(dst, meta, verify=True))
                except BucketChecksumError as e:
                    raise AdapterSyncError(f"shared memory {seg} (adapter version {version}): {e}") from None
                t_copy += tb - ta
                t_verify += time.perf_counter() - tb
        finally:
            for seg in pending:
                _unlink(seg)
        tensors = assemble(buckets, verify=False)
        return Adapter(tensors, man["adapter_config"], source=f"shm:{self.name(version)}",
                       extra={"sync_timings": {"copy_s": t_copy, "verify_s": t_verify,
                                               "bytes": sum(b.nbytes for b in buckets)}})

    def discard(self, version: int, max_buckets: int = 1 << 16) -> int:
        """Unlink whatever is left of ``version`` (never received); returns the number of segments removed."""
        removed = int(_unlink(self.name(version)))
        for i in range(max_buckets):
            if not _unlink(self.name(version, i)):
                break
            removed += 1
        return removed
