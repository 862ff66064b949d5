"""Bucketed adapter streaming (kimi_core/sync/buckets.py, checksum.py): lossless flattening, corruption detection,
expert-row filtering."""

from __future__ import annotations

import pytest
import torch

from kimi_core.lora import LoraSpec, convert_layout, load_adapter, random_adapter
from kimi_core.sync.buckets import Bucket, BucketChecksumError, assemble, filter_experts, iter_buckets
from kimi_core.sync.checksum import region_sums


@pytest.fixture(scope="module")
def k3_ad(k3_tiny):
    c = k3_tiny
    return c, random_adapter(
        c, LoraSpec(rank=4, expert_layout="shared_outer"), seed=9, layout="per_expert", dtype=torch.bfloat16
    )


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 20_000, 1 << 30], ids=["1B", "3kB", "20kB", "1GB"])
def test_buckets_round_trip_bit_exact(k3_ad, bucket_bytes):
    """Every tensor comes back bit-exact, in order, and a bucket exceeds the size only for one oversized tensor."""
    c, ad = k3_ad
    buckets = list(iter_buckets(ad.tensors, bucket_bytes))
    for b in buckets:
        assert b.nbytes <= bucket_bytes or len(b.metas) == 1
        assert b.buffer.dtype == torch.uint8 and b.buffer.is_contiguous()
        assert all(m.offset % 64 == 0 for m in b.metas)
    # the receiver side: only the buffer and the JSON-able metadata travel
    got = assemble(Bucket.from_parts(b.buffer.clone(), b.metadata()) for b in buckets)
    assert list(got) == list(ad.tensors)
    for k, v in ad.tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_flipped_byte_anywhere_is_detected(k3_ad):
    """Flipping any single bit of any byte of a bucket (data or padding) fails verification naming the tensor."""
    c, ad = k3_ad
    b = next(iter(iter_buckets(ad.tensors, 1 << 16)))
    n = b.nbytes
    gen = torch.Generator().manual_seed(0)
    positions = sorted({0, 1, 7, 8, n - 1, n - 8, *torch.randint(0, n, (100,), generator=gen).tolist()})
    for pos in positions:
        for bit in (0, 7):
            buf = b.buffer.clone()
            buf[pos] ^= 1 << bit
            owner = max((m for m in b.metas if m.offset <= pos), key=lambda m: m.offset)
            with pytest.raises(BucketChecksumError, match=f"tensor '{owner.name}'"):
                Bucket.from_parts(buf, b.metadata())


def test_reordered_blocks_and_metadata_edits_are_detected():
    """Swapping two 32 kB blocks inside one tensor, or editing a name in the metadata, is detected."""
    t = {"base_model.model.x.lora_A.weight": torch.randn(4, 16384)}  # 256 kB: 8 blocks of 4096 words
    b = next(iter(iter_buckets(t, 1 << 30)))
    buf = b.buffer.clone()
    blk = 4096 * 8
    buf[:blk], buf[blk : 2 * blk] = b.buffer[blk : 2 * blk].clone(), b.buffer[:blk].clone()
    with pytest.raises(BucketChecksumError, match="corrupt"):
        Bucket.from_parts(buf, b.metadata())
    meta = b.metadata()
    meta["tensors"][0][0] = "base_model.model.y.lora_A.weight"
    with pytest.raises(BucketChecksumError, match="metadata checksum"):
        Bucket.from_parts(b.buffer, meta)


def test_region_sums_match_python_reference():
    """The vectorised sums equal a direct Python computation of the documented formula."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.randint(0, 256, (3 * 4096 * 8 + 64 * 5,), dtype=torch.uint8, generator=gen)
    starts = [0, 64, 64, 4096 * 8 * 2 + 64]
    M = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    words = [int.from_bytes(bytes(buf[i : i + 8].tolist()), "little") for i in range(0, buf.numel(), 8)]
    bounds = [s // 8 for s in starts] + [len(words)]
    want = []
    for i in range(len(starts)):
        a, b = bounds[i], bounds[i + 1]
        acc = 0
        for k, bs in enumerate(range(a, b, 4096)):
            blk = sum(words[bs : min(bs + 4096, b)]) & M
            w = (((2 * k + 1) * 0x9E3779B97F4A7C15) & M) | 1
            acc = (acc + blk * w) & M
        want.append(mix((acc + (b - a)) & M))
    assert region_sums(buf, starts) == want


@pytest.mark.parametrize("layout", ["per_expert", "per_expert_3d", "shared_outer", "stacked"])
def test_expert_filter_gives_exactly_the_rank_slice(k3_ad, layout):
    """Filtering [lo, hi) keeps shared factors and dense modules and yields exactly those experts' factors."""
    c, ad0 = k3_ad
    ad = convert_layout(ad0, c, layout)
    full = load_adapter(ad, c)
    lo, hi = 1, 4
    got = assemble(iter_buckets(ad.tensors, 4096, config=c, experts=(lo, hi)))
    part = load_adapter(got, c, adapter_config=ad.adapter_config, expert_range=(lo, hi))
    assert part.modules() == full.modules()
    moe = "language_model.model.layers.2.block_sparse_moe"
    for e in range(c.n_routed_experts):
        for p in c.expert_names:
            f = part.expert(moe, e, p)
            if not lo <= e < hi:
                assert f is None
                continue
            g = full.expert(moe, e, p)
            assert torch.equal(f.A, g.A) and torch.equal(f.B, g.B) and f.scaling == g.scaling
    shared = [k for k, v in got.items() if ".experts." in k and v.ndim == 3 and v.shape[0] == 1]
    if layout == "shared_outer":
        assert len(shared) == 3 * 3  # gate A, up A, down B per MoE layer, kept whole
    n_keep = sum(1 for k in got if ".experts." in k and "shared" not in k)
    n_full = sum(1 for k in ad.tensors if ".experts." in k and "shared" not in k)
    assert n_keep == (n_full * (hi - lo) // c.n_routed_experts if layout == "per_expert" else n_full)


def test_filter_experts_rejects_bad_range(k3_ad):
    """An expert range outside the model is an error, not an empty result."""
    c, ad = k3_ad
    with pytest.raises(ValueError, match=r"\[3, 9\)"):
        filter_experts(ad.tensors, c, 3, 9)
