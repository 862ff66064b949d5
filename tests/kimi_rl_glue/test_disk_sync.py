"""Disk adapter sync (kimi_rl_glue/sync/disk.py): bit-exact round trip, corruption named, versions never reused."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from shm_publisher import make_adapter  # noqa: E402

from kimi_rl_glue.sync import AdapterSyncError, DiskAdapterSync  # noqa: E402

BUCKET = 16 << 10  # several buckets for the tiny adapter


def test_round_trip_is_bit_exact(tmp_path):
    """What receive returns equals the published tensors exactly, and the verify time is reported."""
    ad = make_adapter(3)
    sync = DiskAdapterSync(str(tmp_path), BUCKET)
    path, t = sync.publish(ad, 1)
    assert len([f for f in os.listdir(path) if f.startswith("bucket_")]) > 1 and t["bytes"] == ad.nbytes
    got = sync.receive(1)
    assert got.tensors.keys() == ad.tensors.keys()
    assert all(torch.equal(got.tensors[k], ad.tensors[k]) for k in ad.tensors)
    assert got.extra["sync_timings"]["verify_s"] > 0


def test_flipped_byte_and_reused_version_are_named(tmp_path):
    """A flipped byte in a bucket file raises naming the file and tensor; republishing a version is refused."""
    ad = make_adapter(4)
    sync = DiskAdapterSync(str(tmp_path), BUCKET)
    path, _ = sync.publish(ad, 2)
    f = os.path.join(path, "bucket_0001.bin")
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0x01
    open(f, "wb").write(b)
    with pytest.raises(AdapterSyncError, match=r"bucket_0001\.bin.*is corrupt"):
        sync.receive(2)
    with pytest.raises(AdapterSyncError, match="never reused"):
        sync.publish(ad, 2)
