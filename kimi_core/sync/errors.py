"""The adapter sync's errors: a version the receiver refuses. The engine keeps serving the last good one."""

from __future__ import annotations

from kimi_core.errors import KimiError

__all__ = ["AdapterSyncError", "BucketChecksumError"]


class AdapterSyncError(KimiError, RuntimeError):
    """A published adapter version is missing, incomplete, corrupt or stale; the message names the version,
    the file or bucket and the tensor. The previous version stays loaded."""


class BucketChecksumError(AdapterSyncError, ValueError):
    """A received bucket's bytes or metadata do not match their checksums; names the bucket and the tensor."""
