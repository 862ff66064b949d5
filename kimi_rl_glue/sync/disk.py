"""Adapter-only sync through a directory (the vLLM path): checksummed buckets, atomic versions.

The trainer's writer (one per node) publishes version ``k`` of the adapter as
``<root>/v{k:06d}/`` holding ``bucket_0000.bin ...`` (flat uint8 buffers from
:func:`kimi_core.lora.iter_buckets`, each tensor with a 64-bit position-weighted checksum) and
``manifest.json`` (bucket metadata, the PEFT ``adapter_config``, the version). It is written under
a temporary name and moved into place with ``os.replace``, so a reader never sees half a version.
The reader verifies every bucket before anything reaches the engine (its read and verify times
go into ``adapter.extra["sync_timings"]``, as :mod:`.shm` does): a flipped byte raises
:class:`AdapterSyncError` naming the version, bucket and tensor, and the engine keeps serving the
previous adapter. Versions are never reused (a reused vLLM adapter name can serve stale prefix
cache, vllm#42125).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from kimi_core.errors import KimiError
from kimi_core.lora import Adapter, Bucket, BucketChecksumError, assemble, iter_buckets

MANIFEST = "manifest.json"


class AdapterSyncError(KimiError, RuntimeError):
    """A published adapter version is missing, incomplete or corrupt; the previous one stays loaded."""


class DiskAdapterSync:
    """:param root: shared (or node-local) directory; :param bucket_bytes: size of one bucket file."""

    def __init__(self, root: str, bucket_bytes: int = 64 << 20):
        self.root = root
        self.bucket_bytes = bucket_bytes
        os.makedirs(root, exist_ok=True)

    def path(self, version: int) -> str:
        return os.path.join(self.root, f"v{version:06d}")

    def publish(self, adapter: Adapter, version: int) -> tuple[str, dict]:
        """Write ``adapter`` as version ``version``; returns ``(path, {"publish_s", "bytes"})``."""
        final = self.path(version)
        if os.path.exists(final):
            raise AdapterSyncError(f"{final}: adapter version {version} already exists; versions are never reused")
        tmp = f"{final}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        t0 = time.perf_counter()
        metas = []
        for b in iter_buckets(adapter.tensors, self.bucket_bytes):
            with open(os.path.join(tmp, f"bucket_{b.index:04d}.bin"), "wb") as f:
                f.write(b.buffer.numpy().tobytes())
            metas.append(b.metadata())
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"version": version, "buckets": metas, "adapter_config": adapter.adapter_config}, f)
        os.replace(tmp, final)
        return final, {"publish_s": time.perf_counter() - t0, "bytes": adapter.nbytes}

    def receive(self, version: int) -> Adapter:
        """Read and verify version ``version``; raises :class:`AdapterSyncError` on any problem."""
        d = self.path(version)
        try:
            with open(os.path.join(d, MANIFEST)) as f:
                man = json.load(f)
        except FileNotFoundError:
            raise AdapterSyncError(f"{d}: adapter version {version} has no {MANIFEST} (not published?)") from None
        buckets = []
        t_read = t_verify = 0.0
        for meta in man["buckets"]:
            p = os.path.join(d, f"bucket_{int(meta['index']):04d}.bin")
            ta = time.perf_counter()
            try:
                with open(p, "rb") as f:
                    raw = bytearray(os.fstat(f.fileno()).st_size)
                    f.readinto(raw)
            except FileNotFoundError:
                raise AdapterSyncError(f"{p}: bucket file missing from adapter version {version}") from None
            tb = time.perf_counter()
            try:
                buckets.append(Bucket.from_parts(torch.frombuffer(raw, dtype=torch.uint8), meta, verify=True))
            except BucketChecksumError as e:
                raise AdapterSyncError(f"{p}: {e}") from None
            t_read += tb - ta
            t_verify += time.perf_counter() - tb
        # views into the received buffers (each tensor keeps its buffer alive): no further copy
        return Adapter(assemble(buckets, verify=False), man["adapter_config"], source=d,
                       extra={"sync_timings": {"read_s": t_read, "verify_s": t_verify,
                                               "bytes": sum(b.nbytes for b in buckets)}})
