"""The manifest of one adapter version: what the trainer publishes beside the bucket bytes.

``{"version": k, "adapter_config": {...PEFT...}, "buckets": [Bucket.metadata(), ...], "digest": ...}``:
the version number (a receiver refuses any other: a stale or reordered version never replaces a newer
one), the PEFT ``adapter_config``, every bucket's metadata (tensor names, dtypes, shapes, offsets and
tensor sums, with the bucket's own metadata digest) and the :func:`~kimi_core.sync.checksum.json_digest`
of all of it. :meth:`AdapterManifest.verify` checks received bucket buffers against it and returns the
tensors; every failure is an :class:`~kimi_core.sync.errors.AdapterSyncError` naming the version, the
bucket and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kimi_core.sync.buckets import Bucket, assemble
from kimi_core.sync.checksum import json_digest
from kimi_core.sync.errors import AdapterSyncError, BucketChecksumError

__all__ = ["AdapterManifest"]


@dataclass(frozen=True)
class AdapterManifest:
    """One published adapter version.

    :ivar version: the adapter version (positive, never reused).
    :ivar adapter_config: the PEFT ``adapter_config`` dict.
    :ivar buckets: each bucket's :meth:`~kimi_core.sync.buckets.Bucket.metadata`, in order.
    """

    version: int
    adapter_config: dict
    buckets: tuple[dict, ...]

    @classmethod
    def of(cls, version: int, adapter_config: dict, buckets: Sequence[Bucket]) -> AdapterManifest:
        """The manifest of ``buckets`` (sealed: their tensor sums and digests are set)."""
        return cls(int(version), dict(adapter_config), tuple(b.metadata() for b in buckets))

    def _body(self) -> dict:
        return {"version": self.version, "adapter_config": self.adapter_config, "buckets": list(self.buckets)}

    def to_json(self) -> str:
        """The manifest with its digest, as JSON text."""
        body = self._body()
        return json.dumps({**body, "digest": json_digest(body)})

    @classmethod
    def from_json(cls, text: str, where: str) -> AdapterManifest:
        """Parse and check a manifest read from ``where`` (a file or channel, for errors)."""
        try:
            raw = json.loads(text)
            body = {k: raw[k] for k in ("version", "adapter_config", "buckets")}
            sent = raw["digest"]
        except (ValueError, KeyError, TypeError) as e:
            raise AdapterSyncError(
                f"{where}: adapter manifest is not complete JSON ({type(e).__name__}: {e})"
            ) from None
        if json_digest(body) != sent:
            raise AdapterSyncError(f"{where}: adapter manifest digest does not match its contents (altered or damaged)")
        return cls(int(body["version"]), body["adapter_config"], tuple(body["buckets"]))

    def expect_version(self, version: int, where: str) -> None:
        """Refuse a manifest of another version than the one asked for (a stale or reordered publish)."""
        if self.version != version:
            raise AdapterSyncError(
                f"{where}: manifest is for adapter version {self.version}, expected {version} (stale adapter)"
            )

    def verify(
        self, buffers: Sequence[torch.Tensor], where: str, bucket_names: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Check each received ``uint8 [nbytes]`` bucket buffer against this manifest (tensor sums, on the
        buffer's device, and metadata digests); returns ``{name: tensor}`` as views into the buffers.

        :param where: names the source in errors (a folder, a channel).
        :param bucket_names: names each bucket's source in errors instead (e.g. its file).
        """
        if len(buffers) != len(self.buckets):
            raise AdapterSyncError(
                f"{where}: adapter version {self.version} has {len(buffers)} buckets, its manifest {len(self.buckets)}"
            )
        buckets = []
        for i, (buf, meta) in enumerate(zip(buffers, self.buckets)):
            try:
                buckets.append(Bucket.from_parts(buf, meta, verify=True))
            except BucketChecksumError as e:
                source = bucket_names[i] if bucket_names else where
                raise BucketChecksumError(f"{source} (adapter version {self.version}): {e}") from None
        return assemble(buckets, verify=False)
