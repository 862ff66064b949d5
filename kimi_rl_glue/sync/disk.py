"""Adapter sync through a directory (the vLLM transport): version ``k`` is a folder of bucket files and
its manifest.

The trainer's writer (one per node) publishes version ``k`` of the adapter as ``<root>/v{k:06d}/`` holding
``bucket_0000.bin ...`` (the flat ``uint8`` buffers of :func:`kimi_core.sync.iter_buckets`) and
``manifest.json`` (:class:`kimi_core.sync.AdapterManifest`). It is written under a temporary name and moved
into place with ``os.replace``, so a reader never sees half a version. The reader checks the manifest and
every bucket before anything reaches the engine: a flipped byte raises
:class:`~kimi_core.sync.AdapterSyncError` naming the bucket file and the tensor, a folder holding another
version's manifest is refused as stale, and the engine keeps serving the previous adapter. Versions are
never reused (a reused vLLM adapter name can serve stale prefix cache, vllm-project/vllm#42125).
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from kimi_core.lora import Adapter
from kimi_core.sync import AdapterManifest, AdapterSyncError, iter_buckets

__all__ = ["DiskAdapterSync", "MANIFEST"]

MANIFEST = "manifest.json"


def _bucket_file(index: int) -> str:
    return f"bucket_{index:04d}.bin"


class DiskAdapterSync:
    """:param root: shared (or node-local) directory; :param bucket_bytes: size of one bucket file."""

    def __init__(self, root: str, bucket_bytes: int = 64 << 20):
        self.root = root
        self.bucket_bytes = bucket_bytes
        os.makedirs(root, exist_ok=True)

    def path(self, version: int) -> str:
        return os.path.join(self.root, f"v{version:06d}")

    def publish(self, adapter: Adapter, version: int) -> tuple[str, dict]:
        """Write ``adapter`` as version ``version``; returns ``(folder, {"publish_s", "bytes"})``."""
        final = self.path(version)
        if os.path.exists(final):
            raise AdapterSyncError(f"{final}: adapter version {version} already exists; versions are never reused")
        tmp = f"{final}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        t0 = time.perf_counter()
        buckets = []
        for b in iter_buckets(adapter.tensors, self.bucket_bytes):
            with open(os.path.join(tmp, _bucket_file(b.index)), "wb") as f:
                f.write(b.buffer.numpy().tobytes())
            buckets.append(b)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            f.write(AdapterManifest.of(version, adapter.adapter_config, buckets).to_json())
        os.replace(tmp, final)
        return final, {"publish_s": time.perf_counter() - t0, "bytes": adapter.nbytes}

    def receive(self, version: int, sent: str | None = None) -> Adapter:
        """Read and verify version ``version`` (from ``sent``, the folder :meth:`publish` returned, or the
        version's folder under the root); raises :class:`~kimi_core.sync.AdapterSyncError` on any problem."""
        d = sent or self.path(version)
        where = os.path.join(d, MANIFEST)
        try:
            with open(where) as f:
                manifest = AdapterManifest.from_json(f.read(), where)
        except FileNotFoundError:
            raise AdapterSyncError(f"{d}: adapter version {version} has no {MANIFEST} (not published?)") from None
        manifest.expect_version(version, where)
        t0 = time.perf_counter()
        buffers, names = [], []
        for meta in manifest.buckets:
            p = os.path.join(d, _bucket_file(int(meta["index"])))
            try:
                with open(p, "rb") as f:
                    raw = bytearray(os.fstat(f.fileno()).st_size)
                    f.readinto(raw)
            except FileNotFoundError:
                raise AdapterSyncError(f"{p}: bucket file missing from adapter version {version}") from None
            buffers.append(torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8))
            names.append(p)
        t1 = time.perf_counter()
        tensors = manifest.verify(buffers, d, names)  # views into the read buffers: no further copy
        timings = {"read_s": t1 - t0, "verify_s": time.perf_counter() - t1, "bytes": sum(b.numel() for b in buffers)}
        return Adapter(tensors, manifest.adapter_config, source=d, extra={"sync_timings": timings})
