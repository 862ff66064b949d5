"""Adapter-only sync over CUDA IPC: trainer GPU buckets opened and copied by an engine process.

The GPU counterpart of :class:`~kimi_rl_glue.sync.shm.ShmAdapterSync` (same bucket format, same
errors), shaped like SGLang's ``update_weights_from_tensor`` path that miles uses when colocated:
the trainer flattens version ``k`` of the adapter into :func:`kimi_core.lora.iter_buckets` buckets
on its own GPU (``device=``, ``block_sums=True``): ``torch.cat`` copies every tensor, then one
kernel writes the bucket's ``int64`` block sums right after its bytes, in the same allocation. It
publishes a *manifest*: bucket metadata plus one CUDA-IPC handle per bucket
(``torch.multiprocessing.reductions.reduce_tensor``), pickled and prefixed by the pickle's BLAKE2b.
The manifest travels by any channel (a pipe, ZMQ, HTTP) to the engine process, which checks the
digest, opens the handles and copies each bucket into its own GPU memory with one kernel that sums
the blocks and compares them with the sender's (read in place, over NVLink when the trainer is
another GPU), raising a device flag; it synchronises once per version: no per-bucket round trip
to the host on either side. On a mismatch it finds the first bad block's tensor on the host and
raises naming it; then it returns the tensors as views into its copies.

Expert sharding: ``publish(..., experts=(lo, hi))`` sends a consumer rank only those experts' rows
(:func:`kimi_core.lora.filter_experts`); publish once per consumer rank with its range.

Lifetime: the trainer keeps each version's buckets alive until :meth:`release` (call it when the
engine has acknowledged the version); the engine's copies are its own. The manifest is a pickle
that only a trusted process on the same node should produce (as SGLang's serialized handles); its
digest catches a truncated or altered manifest before unpickling.

Timings: ``publish`` returns ``flatten_s`` (flatten + sums launched on the trainer GPU, then one
synchronisation) and ``share_s`` (IPC handles, pickle, digest); ``receive`` puts ``open_s``,
``copy_s`` (launching copy + sums + compare) and ``verify_s`` (the one synchronisation and the
flag) into ``adapter.extra["sync_timings"]``. ``checksum=False`` turns the sums, the digest and the
compare off on both sides, to measure what they cost.
"""

from __future__ import annotations

import hashlib
import pickle
import time

import torch

from kimi_core.lora import Adapter, Bucket, BucketChecksumError, assemble, iter_buckets
from kimi_core.lora.buckets import copy_block_sums, n_blocks
from kimi_rl_glue.sync.disk import AdapterSyncError

__all__ = ["CudaIpcAdapterSync"]


class CudaIpcAdapterSync:
    """:param device: this side's GPU (the trainer's for ``publish``, the engine's for ``receive``);
    :param bucket_bytes: size of one bucket; :param checksum: compute and check the sums."""

    def __init__(self, device: torch.device | str | int | None = None, bucket_bytes: int = 256 << 20,
                 checksum: bool = True):
        if not torch.cuda.is_available():
            raise AdapterSyncError("CudaIpcAdapterSync needs a CUDA device; use ShmAdapterSync on CPUs")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self._live: dict[int, list[Bucket]] = {}  # published, not released

    # ------------------------------------------------------------------ trainer side
    def publish(self, adapter: Adapter, version: int, *, experts: tuple[int, int] | None = None,
                config=None) -> tuple[bytes, dict]:
        """Flatten ``adapter`` on this GPU as ``version``; returns ``(manifest, timings)``.

        :param experts: ``(lo, hi)``: only those experts' rows (needs ``config``, the model's
            :class:`~kimi_core.config.KimiConfig`).
        """
        from torch.multiprocessing.reductions import reduce_tensor

        if version in self._live:
            raise AdapterSyncError(f"CUDA IPC: adapter version {version} is already published; "
                                   "versions are never reused")
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            buckets = list(iter_buckets(adapter.tensors, self.bucket_bytes, config=config, experts=experts,
                                        checksum=False, device=self.device, block_sums=self.checksum))
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            handles = [reduce_tensor(b.wire if self.checksum else b.buffer) for b in buckets]
        self._live[version] = buckets
        body = pickle.dumps({"version": version, "adapter_config": adapter.adapter_config,
                             "checksum": self.checksum, "buckets": [b.metadata() for b in buckets],
                             "handles": handles})
        digest = hashlib.blake2b(body, digest_size=16).digest() if self.checksum else bytes(16)
        t2 = time.perf_counter()
        return digest + body, {"publish_s": t2 - t0, "flatten_s": t1 - t0, "share_s": t2 - t1,
                               "bytes": sum(b.nbytes for b in buckets), "buckets": len(buckets)}

    def release(self, version: int) -> None:
        """Free the trainer-side buckets of ``version`` (after the engine acknowledged it)."""
        self._live.pop(version, None)

    # ------------------------------------------------------------------ engine side
    def receive(self, manifest: bytes, version: int) -> Adapter:
        """Open, copy and check every bucket of ``manifest`` on this GPU; raises
        :class:`AdapterSyncError` naming the version, bucket and tensor on any problem."""
        digest, body = manifest[:16], manifest[16:]
        if digest != bytes(16) and hashlib.blake2b(body, digest_size=16).digest() != digest:
            raise AdapterSyncError(f"CUDA IPC: manifest of adapter version {version} fails its BLAKE2b digest "
                                   "(truncated or altered)")
        try:
            man = pickle.loads(body)  # noqa: S301 - a trusted trainer on this node (see module doc)
        except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt manifest
            raise AdapterSyncError(f"CUDA IPC: manifest of adapter version {version} is corrupt: {e}") from None
        if man.get("version") != version:
            raise AdapterSyncError(f"CUDA IPC: manifest is for adapter version {man.get('version')}, "
                                   f"expected {version} (stale adapter)")
        check = bool(man["checksum"])
        buckets, opened, pending, t_open, t_copy = [], [], [], 0.0, 0.0
        with torch.cuda.device(self.device):
            bad = torch.zeros((), dtype=torch.int32, device=self.device)
            try:
                for meta, (rebuild, args) in zip(man["buckets"], man["handles"]):
                    ta = time.perf_counter()
                    src = rebuild(*args)  # the trainer's bucket (and its block sums), mapped into this process
                    opened.append(src)  # stays mapped until the copies have finished (finally below)
                    b = Bucket.from_parts(torch.empty(int(meta["nbytes"]), dtype=torch.uint8, device=self.device),
                                          meta, verify=False)
                    n = b.nbytes
                    want = n + (8 * n_blocks(b.region_starts(), n) if check else 0)
                    if src.dtype != torch.uint8 or src.numel() != want:
                        raise AdapterSyncError(f"CUDA IPC: bucket {b.index} of adapter version {version} has "
                                               f"{src.numel()} {src.dtype} elements, manifest says {want} bytes")
                    tb = time.perf_counter()
                    if check:
                        sent = src[n:].view(torch.int64)
                        got = copy_block_sums(src, b.buffer, b.region_starts(), n, expect=sent, flag=bad)
                        pending.append((b, got, sent))
                    else:
                        b.buffer.copy_(src)
                    buckets.append(b)
                    t_open += tb - ta
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
                opened.clear()
            t_verify = time.perf_counter() - tc
        tensors = assemble(buckets, verify=False)
        return Adapter(tensors, man["adapter_config"], source=f"cuda_ipc:v{version}",
                       extra={"sync_timings": {"open_s": t_open, "copy_s": t_copy, "verify_s": t_verify,
                                               "bytes": sum(b.nbytes for b in buckets)}})
