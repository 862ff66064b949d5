"""Adapter-only sync transports: by disk for vLLM (:mod:`.disk`)."""

from kimi_rl_glue.sync.disk import AdapterSyncError, DiskAdapterSync

__all__ = ["AdapterSyncError", "DiskAdapterSync"]
