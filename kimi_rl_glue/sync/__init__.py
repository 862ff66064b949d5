"""Adapter-only sync transports: by disk for vLLM (:mod:`.disk`), by shared memory as the CPU stand-in
for SGLang's CUDA-IPC buckets (:mod:`.shm`). Both: ``publish(adapter, version) -> (name, timings)``,
``receive(version) -> Adapter``, :class:`AdapterSyncError` on a missing or corrupt version."""

from kimi_rl_glue.sync.disk import AdapterSyncError, DiskAdapterSync
from kimi_rl_glue.sync.shm import ShmAdapterSync

__all__ = ["AdapterSyncError", "DiskAdapterSync", "ShmAdapterSync"]
