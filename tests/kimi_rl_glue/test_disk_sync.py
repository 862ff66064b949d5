"""Disk adapter sync (kimi_rl_glue/sync/disk.py): bit-exact round trip, corruption named, stale and reused
versions refused."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from sync_adapters import make_adapter

from kimi_rl_glue.sync import AdapterSyncError, AdapterTransport, DiskAdapterSync

BUCKET = 16 << 10  # several buckets for the tiny adapter


def test_round_trip_is_bit_exact(tmp_path):
    """What receive returns equals the published tensors exactly, and the verify time is reported."""
    ad = make_adapter(3)
    sync = DiskAdapterSync(str(tmp_path), BUCKET)
    assert isinstance(sync, AdapterTransport)
    path, t = sync.publish(ad, 1)
    assert len([f for f in os.listdir(path) if f.startswith("bucket_")]) > 1 and t["bytes"] == ad.nbytes
    for got in (sync.receive(1), sync.receive(1, path)):
        assert got.tensors.keys() == ad.tensors.keys() and got.adapter_config == ad.adapter_config
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
    with pytest.raises(AdapterSyncError, match=r"bucket_0001\.bin.*tensor '.*lora_[AB]\.weight'.* is corrupt"):
        sync.receive(2)
    with pytest.raises(AdapterSyncError, match="never reused"):
        sync.publish(ad, 2)


def test_stale_version_and_altered_manifest_are_refused(tmp_path):
    """A folder holding version 1's files under version 2's name is refused as stale; a manifest whose
    tensor list was edited fails its digest; a missing manifest is named."""
    ad = make_adapter(5)
    sync = DiskAdapterSync(str(tmp_path), BUCKET)
    path, _ = sync.publish(ad, 1)
    shutil.copytree(path, sync.path(2))
    with pytest.raises(AdapterSyncError, match=r"manifest is for adapter version 1, expected 2 \(stale"):
        sync.receive(2)
    man = os.path.join(path, "manifest.json")
    raw = json.load(open(man))
    raw["buckets"][0]["tensors"][0][0] = "base_model.model.other.lora_A.weight"
    json.dump(raw, open(man, "w"))
    with pytest.raises(AdapterSyncError, match="manifest.json: adapter manifest digest does not match"):
        sync.receive(1)
    with pytest.raises(AdapterSyncError, match="version 3 has no manifest.json"):
        sync.receive(3)
