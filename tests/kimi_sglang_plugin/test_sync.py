"""Adapter sync payloads (kimi_sglang_plugin/sync.py): one per TP rank, flattened buckets SGLang decodes, each EP
rank only its experts, each verified on receipt with kimi_core.sync's checksums; the glue's SGLang transport."""

from __future__ import annotations

import re

import pytest
import torch

from kimi_core.errors import AdapterRejected
from kimi_core.lora import LoraSpec, random_adapter
from kimi_sglang_plugin.adapters import prepare_adapter
from kimi_sglang_plugin.mapping import K3_LORA_LEAVES as SERVED
from kimi_sglang_plugin.sync import BUCKET_KEY, RankLayout, build_payload, decode_payload, sha256_hex, verify_received


def served_adapter(cfg, seed: int, layout: str | None = None, **spec):
    """A random adapter on :data:`SERVED`, in the form SGLang serves (:func:`prepare_adapter`)."""
    kw = {"layout": layout} if layout else {}
    ad = random_adapter(cfg, LoraSpec(target_modules=SERVED, **spec), seed=seed, dtype=torch.bfloat16, **kw)
    return prepare_adapter(ad, cfg)


_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_3D = re.compile(r"\.experts\.(w1|w3|w2)\.lora_[AB]\.weight$")


def reference_slice(tensors: dict, lo: int, hi: int, num_experts: int) -> dict:
    """Independent statement of what EP rank [lo, hi) must receive (not kimi_core.filter_experts):
    per-expert names only for its experts, [E, ...] factors cut to rows lo:hi, shared [1, ...]
    factors and every non-expert module whole."""
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.search(name)
        if m and ".shared_experts." not in name:
            if lo <= int(m.group(1)) < hi:
                out[name] = t
        elif _EXPERT_3D.search(name) and t.shape[0] == num_experts:
            out[name] = t[lo:hi]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize(
    "expert_layout,file_layout,tp,ep",
    [
        ("shared_outer", "shared_outer", 4, 2),
        ("per_expert", "per_expert", 4, 4),
        ("per_expert", "per_expert_3d", 2, 2),
        ("shared_outer", "shared_outer", 2, 1),
    ],
    ids=["shared_outer-tp4-ep2", "per_expert-tp4-ep4", "per_expert_3d-tp2-ep2", "shared_outer-tp2-ep1"],
)
def test_per_rank_payloads_equal_reference_slicing(plugin, k31_config, expert_layout, file_layout, tp, ep):
    """Each TP rank's decoded payload equals the reference slice of the adapter for its EP rank, bit-exactly."""
    cfg = k31_config
    ad = served_adapter(cfg, 3, file_layout, rank=4, alpha=8, expert_layout=expert_layout)
    layout = RankLayout(tp_size=tp, ep_size=ep, num_experts=cfg.n_routed_experts)
    payload = build_payload("kimi", ad.tensors, ad.adapter_config, cfg, layout)
    assert payload.load_format == "flattened_bucket" and len(payload.serialized_named_tensors) == tp
    E = cfg.n_routed_experts
    for r, data in enumerate(payload.serialized_named_tensors):
        lo, hi = (r // (tp // ep)) * (E // ep), (r // (tp // ep) + 1) * (E // ep)
        want = reference_slice(ad.tensors, lo, hi, E)
        got = decode_payload(data)
        assert sorted(got) == sorted(want), f"rank {r}: names differ"
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"rank {r}: {name} differs"
        if ep > 1:
            assert len(got) < len(ad.tensors) or file_layout != "per_expert"


def test_expected_checksums_are_sglang_sha256(plugin, k31_config):
    """Without EP filtering the payload carries SGLang's expected_checksums (sha256 per tensor)."""
    import hashlib

    ad = served_adapter(k31_config, 1, rank=2, alpha=2)
    p = build_payload("kimi", ad.tensors, ad.adapter_config, k31_config, RankLayout(tp_size=2), sha256=True)
    name, t = next(iter(ad.tensors.items()))
    assert p.expected_checksums[name] == hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    assert set(p.expected_checksums) == set(ad.tensors)
    assert p.expected_checksums[name] == sha256_hex(decode_payload(p.serialized_named_tensors[1])[name])


def test_request_matches_sglang_io_struct(plugin, k31_config):
    """The payload fields build SGLang's LoadLoRAAdapterFromTensorsReqInput as-is."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

    ad = served_adapter(k31_config, 2, rank=2, alpha=2)
    p = build_payload("kimi", ad.tensors, ad.adapter_config, k31_config, RankLayout(tp_size=1))
    req = LoadLoRAAdapterFromTensorsReqInput(**p.request_fields())
    assert req.load_format == "flattened_bucket" and req.lora_name == "kimi"


def test_unprepared_adapter_is_refused(plugin, k31_config):
    """An adapter SGLang would misread (capacity-normalised experts through rank_pattern, which SGLang ignores)
    or refuse (our expert leaves as target_modules) is refused before anything is sent, naming the field and
    the fix; its prepared form goes through."""
    ad = random_adapter(
        k31_config,
        LoraSpec(rank=8, alpha=16, target_modules=SERVED, normalize_moe_lora=True),
        seed=4,
        dtype=torch.bfloat16,
    )
    assert ad.adapter_config.get("rank_pattern"), "the normalised experts' ranks ride in rank_pattern"
    with pytest.raises(AdapterRejected, match="adapter 'kimi' adapter_config: rank_pattern is set.*prepare_adapter"):
        build_payload("kimi", ad.tensors, ad.adapter_config, k31_config, RankLayout(tp_size=1))
    cfg = {**ad.adapter_config, "rank_pattern": {}, "alpha_pattern": {}}
    with pytest.raises(AdapterRejected, match=r"target_modules \['w1', 'w2', 'w3'\]"):
        build_payload("kimi", ad.tensors, cfg, k31_config, RankLayout(tp_size=1))
    ok = prepare_adapter(ad, k31_config)
    assert build_payload("kimi", ok.tensors, ok.adapter_config, k31_config, RankLayout(tp_size=1)).lora_name == "kimi"


def test_bad_layout_is_refused():
    """An EP size that does not divide TP or the expert count is refused, naming the flag."""
    with pytest.raises(ValueError, match="--ep-size"):
        RankLayout(tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="num_experts"):
        RankLayout(tp_size=4, ep_size=4, num_experts=6)


def test_received_payload_with_a_flipped_byte_is_refused_naming_the_tensor(plugin, k31_config):
    """The receiving side checks a rank's flat buffer against the bucket record the payload carries: the
    payload as sent passes; one flipped byte (after the sums were taken) raises naming the tensor it lies in."""
    from sglang.srt.utils import MultiprocessingSerializer

    from kimi_core.sync import AdapterSyncError, BucketChecksumError

    ad = served_adapter(k31_config, 7, rank=2, alpha=2)
    p = build_payload("kimi", ad.tensors, ad.adapter_config, k31_config, RankLayout(tp_size=1))
    data = MultiprocessingSerializer.deserialize(p.fields_for_send()["serialized_named_tensors"][0])
    assert set(data) == {"flattened_tensor", "metadata", BUCKET_KEY}
    verify_received(data, "rank 0")
    victim = p.buckets[0].metas[len(p.buckets[0].metas) // 2]
    data["flattened_tensor"][victim.offset + 1] ^= 0x08
    with pytest.raises(BucketChecksumError, match=f"rank 0: bucket 0: tensor '{re.escape(victim.name)}'.*corrupt"):
        verify_received(data, "rank 0")
    del data[BUCKET_KEY]
    with pytest.raises(AdapterSyncError, match="no 'kimi_bucket' record"):
        verify_received(data)


def test_glue_tensor_sync_sends_the_prepared_adapter(plugin, k31_config):
    """``kimi_rl_glue``'s SGLang transport (the miles-k3 loop): version k goes out as ``policy-v<k>``, its one
    payload decodes bit-exactly to what :func:`prepare_adapter` makes of the trainer's adapter and carries no
    SHA-256 (the manifest's checksums instead); a byte flipped in the sent bucket after publishing is refused by
    ``receive`` naming the tensor; only the last version is held, and an unpublished one is refused."""
    from kimi_core.sync import AdapterSyncError, AdapterTransport
    from kimi_rl_glue.demo.sglang_rollout import SglangTensorSync

    raw = random_adapter(
        k31_config,
        LoraSpec(target_modules=SERVED, rank=4, alpha=8, expert_layout="shared_outer"),
        seed=5,
        dtype=torch.bfloat16,
        layout="shared_outer",
    )
    want = prepare_adapter(raw, k31_config).tensors
    sync = SglangTensorSync(k31_config)
    assert isinstance(sync, AdapterTransport)
    name, pub = sync.publish(raw, 3)
    got = sync.receive(3)
    assert name == got.name == got.payload.lora_name == "policy-v3" and pub["bytes"] > 0
    assert got.manifest.version == 3 and got.payload.expected_checksums is None
    assert got.extra["sync_timings"]["verify_s"] > 0
    tensors = decode_payload(got.payload.serialized_named_tensors[0])
    assert sorted(tensors) == sorted(want) and all(torch.equal(tensors[k], want[k]) for k in want)
    sync.publish(raw, 4)
    with pytest.raises(AdapterSyncError, match="adapter version 3 was not published"):
        sync.receive(3)
    bucket = sync.receive(4).payload.buckets[0]
    victim = bucket.metas[0]
    bucket.buffer[victim.offset] ^= 0x01
    with pytest.raises(AdapterSyncError, match=f"SGLang payload policy-v4.*tensor '{re.escape(victim.name)}'"):
        sync.receive(4)


def test_a_payload_sent_twice_is_serialized_again(plugin, k31_config):
    """A CPU bucket travels as a file descriptor that ``multiprocessing.resource_sharer`` hands out once: SGLang's
    own deserializer cannot receive the same bytes twice (on the H200 this killed the scheduler). Each send after
    the first (``fields_for_send``) serializes the buckets again, and SGLang's deserializer (``decode_payload``)
    gets back the adapter bit-exactly every time."""
    ad = served_adapter(k31_config, 6, rank=2, alpha=2)
    p = build_payload("kimi", ad.tensors, ad.adapter_config, k31_config, RankLayout(tp_size=1))
    first = p.fields_for_send()["serialized_named_tensors"][0]
    got = decode_payload(first)
    assert all(torch.equal(got[k], v) for k, v in ad.tensors.items())
    with pytest.raises(EOFError):  # what SGLang's scheduler hit: the same bytes received a second time
        decode_payload(first)
    for _ in range(2):
        again = p.fields_for_send()["serialized_named_tensors"][0]
        assert again is not first
        got = decode_payload(again)
        assert sorted(got) == sorted(ad.tensors) and all(torch.equal(got[k], v) for k, v in ad.tensors.items())
    assert p.sends == 3
