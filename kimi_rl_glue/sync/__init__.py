"""The adapter sync's transports behind the protocol of :mod:`kimi_core.sync` (``publish(adapter, k) ->
(sent, timings)``, ``receive(k, sent) -> Adapter``, :class:`AdapterSyncError` naming the version, bucket and
tensor): by disk for vLLM (:mod:`.disk`), by CUDA IPC for SGLang and miles (:mod:`.cuda_ipc`, imported on
use: it needs a GPU). Which transport a host uses is answered by the plugins' ``kimi_rl_sync_transports``
hook (:func:`kimi_rl_glue.plugins.sync_transports`)."""

from kimi_core.sync import AdapterSyncError, AdapterTransport
from kimi_rl_glue.sync.disk import DiskAdapterSync

__all__ = ["AdapterSyncError", "AdapterTransport", "DiskAdapterSync"]
