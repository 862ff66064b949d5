"""The adapter manifest (kimi_core/sync/manifest.py): a JSON round trip with its digest; altered manifests,
stale versions and flipped bytes refused by name."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kimi_core.sync import AdapterManifest, AdapterSyncError, BucketChecksumError, iter_buckets


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"base_model.model.layers.{i}.mlp.up_proj.lora_{ab}.weight": torch.randn(24, 300, generator=g).bfloat16()
        for i in range(3)
        for ab in "AB"
    }


def test_round_trip_and_digest_is_blake2b_of_the_body():
    """The manifest's digest is BLAKE2b-128 of its canonical JSON body (hashlib, written out here), and a
    parsed manifest verifies the buckets into the exact tensors."""
    tensors = _tensors()
    buckets = list(iter_buckets(tensors, 20_000))
    text = AdapterManifest.of(7, {"r": 24}, buckets).to_json()
    raw = json.loads(text)
    body = {k: raw[k] for k in ("version", "adapter_config", "buckets")}
    assert raw["digest"] == hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    got = AdapterManifest.from_json(text, "chan").verify([b.buffer.clone() for b in buckets], "chan")
    assert list(got) == list(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_altered_stale_and_corrupt_are_refused():
    """An edited shape fails the digest; another version is stale; one flipped byte names its tensor."""
    tensors = _tensors()
    buckets = list(iter_buckets(tensors, 20_000))
    man = AdapterManifest.of(7, {"r": 24}, buckets)
    raw = json.loads(man.to_json())
    raw["buckets"][0]["tensors"][0][2] = [12, 600]
    with pytest.raises(AdapterSyncError, match="chan: adapter manifest digest does not match"):
        AdapterManifest.from_json(json.dumps(raw), "chan")
    with pytest.raises(AdapterSyncError, match="not complete JSON"):
        AdapterManifest.from_json(man.to_json()[:-9], "chan")
    with pytest.raises(AdapterSyncError, match="version 7, expected 8 \\(stale"):
        man.expect_version(8, "chan")
    bufs = [b.buffer.clone() for b in buckets]
    victim = buckets[1].metas[0]
    bufs[1][victim.offset + 5] ^= 0x20
    with pytest.raises(BucketChecksumError, match=f"chan \\(adapter version 7\\): bucket 1: tensor '{victim.name}'"):
        man.verify(bufs, "chan")
    with pytest.raises(AdapterSyncError, match="has 1 buckets, its manifest"):
        man.verify(bufs[:1], "chan")
