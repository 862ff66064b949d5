"""The adapter sync protocol, trainer -> engine, that every transport implements.

The trainer publishes each adapter version ``k`` (1, 2, ...; never reused) with
``publish(adapter, k) -> (sent, timings)``; ``sent`` is what reaches the engine side (a folder path, a
framed manifest of CUDA-IPC handles, an engine request). The engine side calls ``receive(k, sent)``,
which verifies every byte against the version's :class:`~kimi_core.sync.manifest.AdapterManifest` with
the scheme of :mod:`kimi_core.sync.checksum` and returns the adapter, or raises
:class:`~kimi_core.sync.errors.AdapterSyncError` naming the version, bucket and tensor (a flipped byte,
a stale version, a missing bucket); the engine then keeps serving the previous version. ``timings``
and the receiver's ``adapter.extra["sync_timings"]`` hold seconds and ``bytes``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["AdapterTransport"]


@runtime_checkable
class AdapterTransport(Protocol):
    """A transport of adapter versions (see the module docstring)."""

    def publish(self, adapter: Any, version: int) -> tuple[Any, dict]:
        """Send ``adapter`` (a :class:`kimi_core.lora.Adapter`) as ``version``; returns ``(sent, timings)``."""
        ...

    def receive(self, version: int, sent: Any = None) -> Any:
        """The verified adapter of ``version``; ``sent`` is what :meth:`publish` returned first (transports that
        find a version by its number accept ``None``)."""
        ...
