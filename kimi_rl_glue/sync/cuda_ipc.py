"""Adapter-only sync over CUDA IPC: trainer GPU buckets opened and copied by an engine process.

The GPU counterpart of :class:`~kimi_rl_glue.sync.shm.ShmAdapterSync` (same bucket format, same
errors), shaped like SGLang's ``update_weights_from_tensor`` path that miles uses when colocated:
the trainer flattens version ``k`` of the adapter into :func:`kimi_core.lora.iter_buckets` buckets
on its own GPU (``device=``), each tensor with its 64-bit checksum computed on the GPU, and
publishes a *manifest*: bucket metadata plus one CUDA-IPC handle per bucket
(``torch.multiprocessing.reductions.reduce_tensor``), pickled. The manifest travels by any channel
(a pipe, ZMQ, HTTP) to the engine process, which opens each handle, copies the bucket into its own
GPU memory and checks it in the same kernel
(:func:`kimi_core.lora.buckets.copy_region_sums`: the checksum rides in the copy, so it costs
almost nothing beyond the transfer), then returns the tensors as views into its copies.

Expert sharding: ``publish(..., experts=(lo, hi))`` sends a consumer rank only those experts' rows
(:func:`kimi_core.lora.filter_experts`); publish once per consumer rank with its range.

Lifetime: the trainer keeps each version's buckets alive until :meth:`release` (call it when the
engine has acknowledged the version); the engine's copies are its own. The manifest is a pickle
that only a trusted process on the same node should produce (as SGLang's serialized handles).

Timings: ``publish`` returns ``flatten_s`` (copies + sums on the trainer GPU) and ``share_s``
(IPC handles); ``receive`` puts ``open_s``, ``copy_s`` (copy + sums) and ``verify_s`` into
``adapter.extra["sync_timings"]``. ``checksum=False`` turns the sums off on both sides (the
receiver then does a plain copy), to measure what they cost.
"""

from __future__ import annotations

import pickle
import time

import torch

from kimi_core.lora import Adapter, Bucket, BucketChecksumError, assemble, iter_buckets
from kimi_core.lora.buckets import copy_region_sums
from kimi_rl_glue.sync.disk import AdapterSyncError

__all__ = ["CudaIpcAdapterSync"]


class CudaIpcAdapterSync:
    """:param device: this side's GPU (the trainer's for ``publish``, the engine's for ``receive``);
    :param bucket_bytes: size of one bucket; :param checksum: compute and check the sums."""

    def __init__(self, device: torch.device | str | int | None = None, bucket_bytes: int = 256 << 20,
                 checksum: bool = True):
        if not torch.cuda.is_available():
            raise AdapterSyncError("CudaIpcAdapterSync needs a CUDA device; use ShmAdapterSync on CPUs")
        self.device = torch.device("cuda", torch.device(device).index if isinstance(device, (str, torch.device))
                                   else (device if device is not None else torch.cuda.current_device()))
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self._live: dict[int, list[Bucket]] = {}  # published versions not yet released

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
                                        checksum=self.checksum, device=self.device))
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            handles = [reduce_tensor(b.buffer) for b in buckets]
        self._live[version] = buckets
        body = pickle.dumps({"version": version, "adapter_config": adapter.adapter_config,
                             "checksum": self.checksum, "buckets": [b.metadata() for b in buckets],
                             "handles": handles})
        t2 = time.perf_counter()
        return body, {"publish_s": t2 - t0, "flatten_s": t1 - t0, "share_s": t2 - t1,
                      "bytes": sum(b.nbytes for b in buckets), "buckets": len(buckets)}

    def release(self, version: int) -> None:
        """Free the trainer-side buckets of ``version`` (after the engine acknowledged it)."""
        self._live.pop(version, None)

    # ------------------------------------------------------------------ engine side
    def receive(self, manifest: bytes, version: int) -> Adapter:
        """Open, copy and check every bucket of ``manifest`` on this GPU; raises
        :class:`AdapterSyncError` naming the version, bucket and tensor on any problem."""
        try:
            man = pickle.loads(manifest)  # noqa: S301 - a trusted trainer on this node (see module doc)
        except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt manifest
            raise AdapterSyncError(f"CUDA IPC: manifest of adapter version {version} is corrupt: {e}") from None
        if man.get("version") != version:
            raise AdapterSyncError(f"CUDA IPC: manifest is for adapter version {man.get('version')}, "
                                   f"expected {version} (stale adapter)")
        check = bool(man["checksum"])
        buckets, t_open, t_copy, t_verify = [], 0.0, 0.0, 0.0
        with torch.cuda.device(self.device):
            for meta, (rebuild, args) in zip(man["buckets"], man["handles"]):
                ta = time.perf_counter()
                src = rebuild(*args)  # the trainer's bucket, mapped into this process
                n = int(meta["nbytes"])
                if src.dtype != torch.uint8 or src.numel() != n:
                    raise AdapterSyncError(f"CUDA IPC: bucket {meta['index']} of adapter version {version} has "
                                           f"{src.numel()} {src.dtype} elements, manifest says {n} bytes")
                dst = torch.empty(n, dtype=torch.uint8, device=self.device)
                tb = time.perf_counter()
                if check:
                    b = Bucket.from_parts(dst, meta, verify=False)
                    sums = copy_region_sums(src, dst, b.region_starts(), n)
                else:
                    dst.copy_(src)
                    torch.cuda.synchronize(self.device)
                    b = Bucket.from_parts(dst, meta, verify=False)
                del src
                tc = time.perf_counter()
                if check:
                    try:
                        b.verify(sums)
                    except BucketChecksumError as e:
                        raise AdapterSyncError(f"CUDA IPC (adapter version {version}): {e}") from None
                buckets.append(b)
                t_open += tb - ta
                t_copy += tc - tb
                t_verify += time.perf_counter() - tc
        tensors = assemble(buckets, verify=False)
        return Adapter(tensors, man["adapter_config"], source=f"cuda_ipc:v{version}",
                       extra={"sync_timings": {"open_s": t_open, "copy_s": t_copy, "verify_s": t_verify,
                                               "bytes": sum(b.nbytes for b in buckets)}})
