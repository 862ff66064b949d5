"""Shared-memory adapter sync (kimi_rl_glue/sync/shm.py): across processes, bit-exact, corruption named."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # shm_publisher, importable by the spawned child

from shm_publisher import make_adapter, publish  # noqa: E402

from kimi_rl_glue.sync import AdapterSyncError, ShmAdapterSync  # noqa: E402
from kimi_rl_glue.sync.shm import attach_segment  # noqa: E402

BUCKET = 16 << 10  # several buckets for the tiny adapter


def test_publish_in_child_receive_in_parent_bit_exact():
    """The child publishes and exits (its segments must survive it); the parent receives, bit-exact, and
    the version's segments are gone afterwards."""
    sync = ShmAdapterSync(bucket_bytes=BUCKET)
    p = mp.get_context("spawn").Process(target=publish, args=(sync.channel, 1, 7, BUCKET))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    got = sync.receive(1)
    want = make_adapter(7)
    assert list(got.tensors) == list(want.tensors) and got.adapter_config == want.adapter_config
    for k, v in want.tensors.items():
        assert got.tensors[k].dtype == v.dtype and torch.equal(got.tensors[k], v), k
    assert got.extra["sync_timings"]["bytes"] >= want.nbytes
    assert sync.discard(1) == 0  # nothing left behind
    with pytest.raises(AdapterSyncError, match="version 1 was not published"):
        sync.receive(1)


def test_flipped_byte_names_tensor_and_cleans_up():
    sync = ShmAdapterSync(bucket_bytes=BUCKET)
    ad = make_adapter(3)
    name, timings = sync.publish(ad, 5)
    assert name == sync.name(5) and timings["buckets"] > 1
    with pytest.raises(AdapterSyncError, match="already exists"):
        sync.publish(ad, 5)
    seg = attach_segment(sync.name(5, 1))
    seg.buf[100] ^= 0x10
    seg.close()
    named = r"_v5_1 \(adapter version 5\): bucket 1: tensor '.*lora_[AB]\.weight'.* corrupt"
    with pytest.raises(AdapterSyncError, match=named):
        sync.receive(5)
    assert sync.discard(5) == 0


def test_discard_removes_an_unreceived_version():
    sync = ShmAdapterSync(bucket_bytes=BUCKET)
    _, t = sync.publish(make_adapter(1), 2)
    assert sync.discard(2) == t["buckets"] + 1
