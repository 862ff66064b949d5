"""Adapter sync, trainer -> engine, without a framework: the protocol (:mod:`.protocol`), the manifest of a
version (:mod:`.manifest`), the one integrity scheme (:mod:`.checksum`: block sums for the bytes, BLAKE2b for
the metadata, the same numbers on the CPU and on the GPU), bucketing (:mod:`.buckets`) and the GPU side of
it (:mod:`.block_tables`, :mod:`.version_layout`). The transports live in ``kimi_rl_glue.sync``; the SGLang
payload in ``kimi_sglang_plugin.sync``.
"""

from kimi_core.sync.buckets import Bucket, TensorMeta, assemble, filter_experts, iter_buckets
from kimi_core.sync.checksum import region_sums
from kimi_core.sync.errors import AdapterSyncError, BucketChecksumError
from kimi_core.sync.manifest import AdapterManifest
from kimi_core.sync.protocol import AdapterTransport

__all__ = [
    "AdapterManifest",
    "AdapterSyncError",
    "AdapterTransport",
    "Bucket",
    "BucketChecksumError",
    "TensorMeta",
    "assemble",
    "filter_experts",
    "iter_buckets",
    "region_sums",
]
