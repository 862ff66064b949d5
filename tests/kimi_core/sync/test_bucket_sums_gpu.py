"""GPU bucket checksums (kimi_core/kernels/block_sums.py: Triton block sums, fused copy) equal the numpy ones of
kimi_core/sync/checksum.py; CPU copy path too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kimi_core.sync import iter_buckets
from kimi_core.sync.checksum import BLOCK_WORDS, copy_block_sums, copy_region_sums, region_sums
from kimi_core.sync.version_layout import flatten_version


def _regions(seed: int) -> tuple[torch.Tensor, list[int]]:
    """A random byte buffer cut into 8-aligned regions: empty, sub-block, exactly one block, many blocks."""
    g = np.random.default_rng(seed)
    sizes = [0, 8, 40, BLOCK_WORDS * 8, BLOCK_WORDS * 8 + 8, 3 * BLOCK_WORDS * 8 - 16, 64]
    sizes += [int(x) * 8 for x in g.integers(1, 5 * BLOCK_WORDS, 5)]
    starts = list(np.cumsum([0] + sizes[:-1]))
    buf = torch.from_numpy(g.integers(0, 256, sum(sizes), dtype=np.uint8))
    return buf, [int(s) for s in starts]


def test_copy_region_sums_cpu_copies_and_sums():
    buf, starts = _regions(0)
    dst = torch.empty_like(buf)
    assert copy_region_sums(buf, dst, starts) == region_sums(buf, starts)
    assert torch.equal(dst, buf)


def test_copy_block_sums_rejects_a_short_or_wrong_buffer():
    """The GPU kernel writes through raw addresses, so every path checks the buffers first."""
    buf, starts = _regions(1)
    with pytest.raises(ValueError, match="dst must be contiguous uint8 of >= "):
        copy_block_sums(buf, torch.empty(buf.numel() - 8, dtype=torch.uint8), starts)
    with pytest.raises(ValueError, match="dst must be contiguous uint8"):
        copy_block_sums(buf, torch.empty(buf.numel() // 8, dtype=torch.int64), starts)
    with pytest.raises(ValueError, match="src must be contiguous uint8"):
        copy_block_sums(buf[::2], None, starts, buf.numel() // 2)


def _brute_block_sums(buf: torch.Tensor, starts: list[int]) -> list[int]:
    """Python-int block sums mod 2^64: every region cut into BLOCK_WORDS-word blocks from its start."""
    words = buf.numpy().view(np.uint64).tolist()
    bounds = [s // 8 for s in starts] + [len(words)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        for s in range(a, b, BLOCK_WORDS):
            out.append(sum(words[s : min(s + BLOCK_WORDS, b)]) % (1 << 64))
    return out


def test_block_sums_equal_brute_force_and_name_the_corrupt_tensor():
    buf, starts = _regions(4)
    dst = torch.empty_like(buf)
    got = copy_block_sums(buf, dst, starts)
    assert got.numpy().view(np.uint64).tolist() == _brute_block_sums(buf, starts)
    assert torch.equal(dst, buf)
    bad = buf.clone()
    victim = 5  # a multi-block region
    bad[starts[victim] + 8 * BLOCK_WORDS + 3] ^= 0x40
    from kimi_core.sync.checksum import first_bad_region

    assert first_bad_region(copy_block_sums(bad, None, starts), got, starts, buf.numel()) == victim
    assert first_bad_region(got, got, starts, buf.numel()) is None


def test_bucket_check_blocks_names_the_tensor():
    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate([3, 5000, 70000, 11])}
    b = next(iter_buckets(tensors, 1 << 30, checksum=False))
    sent = copy_block_sums(b.buffer, None, b.region_starts(), b.nbytes)
    b.buffer[b.metas[2].offset + 40000] ^= 1
    with pytest.raises(ValueError, match="'t2'"):
        b.check_blocks(copy_block_sums(b.buffer, None, b.region_starts(), b.nbytes), sent)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_region_sums_equal_numpy(seed):
    buf, starts = _regions(seed)
    want = region_sums(buf, starts)  # numpy, independent of the Triton kernel
    dev = buf.cuda()
    assert region_sums(dev, starts) == want
    dst = torch.zeros_like(dev)
    assert copy_region_sums(dev, dst, starts) == want
    assert torch.equal(dst.cpu(), buf)
    assert torch.equal(copy_block_sums(dev, None, starts).cpu(), copy_block_sums(buf, None, starts))


@pytest.mark.gpu
def test_gpu_buckets_equal_cpu_buckets():
    g = torch.Generator().manual_seed(3)
    tensors = {
        f"t{i}": torch.randn(n, generator=g).to(dt)
        for i, (n, dt) in enumerate(
            [(1000, torch.bfloat16), (7, torch.float32), (40000, torch.bfloat16), (3, torch.bfloat16)]
        )
    }
    cpu = list(iter_buckets(tensors, 64 << 10))
    gpu = list(iter_buckets({k: v.cuda() for k, v in tensors.items()}, 64 << 10, device="cuda"))
    assert [b.checksum for b in cpu] == [b.checksum for b in gpu]
    for b, c in zip(cpu, gpu):
        assert torch.equal(b.buffer, c.buffer.cpu())
        c.verify()
        c.buffer[c.metas[0].offset] ^= 1
        with pytest.raises(ValueError, match=c.metas[0].name):
            c.verify()


def test_cpu_expect_flag_reports_a_mismatch():
    buf, starts = _regions(5)
    sent = copy_block_sums(buf, None, starts)
    flag = torch.zeros((), dtype=torch.int32)
    copy_block_sums(buf, torch.empty_like(buf), starts, expect=sent, flag=flag)
    assert int(flag) == 0
    wrong = sent.clone()
    wrong[3] += 1
    copy_block_sums(buf, None, starts, expect=wrong, flag=flag)
    assert int(flag) == 1


def _word_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of whole 8-byte words, incl. a view at an 8-byte aligned offset."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 3 * BLOCK_WORDS + 12, generator=g).to(torch.bfloat16)
    return {
        "a": torch.randn(4, 64, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g).double(),
        "big": torch.randn(3 * BLOCK_WORDS + 20, generator=g),
        "row": base[1, 4:],
        "c": torch.randint(-(2**62), 2**62, (BLOCK_WORDS,), generator=g),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("sums", [True, False])
def test_gpu_flatten_with_block_sums(odd, sums):
    """GPU buckets (the gather kernel; with a partial-word tensor, ``odd``, torch.cat) equal the CPU
    flatten byte for byte, and their attached sums the brute-force block sums; twice, the second time
    from the cached gather table."""
    tensors = _word_tensors(7)
    if odd:
        tensors["odd"] = torch.randn(3).to(torch.bfloat16)
    cpu = list(iter_buckets(tensors, 40 << 10, checksum=False))
    on_gpu = {k: v.cuda() for k, v in tensors.items()}
    for i in range(4):  # iter_buckets, twice (cached tables), then flatten_version (one launch), twice
        gpu = (
            list(iter_buckets(on_gpu, 40 << 10, checksum=False, device="cuda", block_sums=sums))
            if i < 2
            else flatten_version(
                on_gpu, 40 << 10, device=torch.device("cuda", torch.cuda.current_device()), block_sums=sums
            )[0]
        )
        assert len(cpu) == len(gpu) > 1
        for c, g in zip(cpu, gpu):
            assert torch.equal(g.buffer.cpu(), c.buffer)
            if sums:
                want = _brute_block_sums(c.buffer, c.region_starts())
                assert g.block_sums.cpu().numpy().view(np.uint64).tolist() == want


@pytest.mark.gpu
def test_gpu_fused_compare_sets_the_flag():
    buf, starts = _regions(6)
    dev = buf.cuda()
    sent = torch.tensor(_brute_block_sums(buf, starts), dtype=torch.uint64).view(torch.int64).cuda()
    flag = torch.zeros((), dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(dev)
    copy_block_sums(dev, dst, starts, expect=sent, flag=flag)
    assert int(flag) == 0 and torch.equal(dst.cpu(), buf)
    sent[len(sent) // 2] ^= 4
    copy_block_sums(dev, dst, starts, expect=sent, flag=flag)
    assert int(flag) == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (peer loads)")
def test_gpu_peer_copy_sums_and_compare():
    """Source and sender's sums on cuda:0, copy and check on cuda:1 (a copy, then the fused sums + compare)."""
    buf, starts = _regions(8)
    src = buf.to("cuda:0")
    sent = torch.tensor(_brute_block_sums(buf, starts), dtype=torch.uint64).view(torch.int64).to("cuda:0")
    dst = torch.zeros(buf.numel(), dtype=torch.uint8, device="cuda:1")
    flag = torch.zeros((), dtype=torch.int32, device="cuda:1")
    got = copy_block_sums(src, dst, starts, expect=sent, flag=flag)
    assert got.device == dst.device and torch.equal(got.cpu(), sent.cpu())
    assert int(flag) == 0 and torch.equal(dst.cpu(), buf)
    sent[0] ^= 1
    copy_block_sums(src, dst, starts, expect=sent, flag=flag)
    assert int(flag) == 1


_INTERP_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_bucket_sums_gpu import _brute_block_sums, _regions, _word_tensors
from kimi_core.kernels.block_sums import copy_sum_blocks
from kimi_core.sync import iter_buckets
from kimi_core.sync.block_tables import bucket_table, flatten_table, gather_addresses, version_table
from kimi_core.sync.checksum import BLOCK_WORDS, n_blocks
cpu = torch.device("cpu")
buf, starts = _regions(9)
table, _ = bucket_table(tuple(starts), buf.numel(), cpu)
want = torch.tensor(_brute_block_sums(buf, starts), dtype=torch.uint64).view(torch.int64)
dst, sums = torch.zeros(buf.numel() // 8, dtype=torch.int64), torch.empty_like(want)
flag = torch.zeros((), dtype=torch.int32)
copy_sum_blocks(table, BLOCK_WORDS, src_base=buf.data_ptr(), dst_base=dst.data_ptr(), sums_base=sums.data_ptr(),
                expect_base=want.data_ptr(), flag=flag)
print("SUMS", torch.equal(sums, want), "COPY", torch.equal(dst.view(torch.uint8), buf), "FLAG0", int(flag))
bad = want.clone(); bad[len(bad) // 2] ^= 1
copy_sum_blocks(table, BLOCK_WORDS, src_base=buf.data_ptr(), sums_base=sums.data_ptr(), expect_base=bad.data_ptr(),
                flag=flag)
print("FLAG1", int(flag))
dst2, sums2 = torch.zeros_like(dst), torch.empty_like(want)  # the streaming cache hints change nothing else
copy_sum_blocks(table, BLOCK_WORDS, src_base=buf.data_ptr(), dst_base=dst2.data_ptr(), sums_base=sums2.data_ptr(),
                stream_hints=True)
print("HINTS", torch.equal(sums2, want) and torch.equal(dst2, dst))
# a tensor's alignment gap reads as zeros: 3 source words into a 5-word block
src = torch.arange(1, 4, dtype=torch.int64)
out = torch.full((5,), -1, dtype=torch.int64)
one = torch.empty(1, dtype=torch.int64)
copy_sum_blocks(torch.tensor([[0], [3], [0], [5], [0], [0]]), BLOCK_WORDS, src_base=src.data_ptr(),
                dst_base=out.data_ptr(), sums_base=one.data_ptr())
print("GAP", out.tolist(), int(one))
# gather: many tensors (absolute source addresses) into one bucket with their block sums, one launch
ts = _word_tensors(3)
print("UNALIGNED", gather_addresses(ts.values(), cpu))  # "row" is a view 32 bytes off
ts.pop("row")
ref = next(iter_buckets(ts, 1 << 30, checksum=False))
out = torch.full((ref.nbytes // 8,), -1, dtype=torch.int64)
s = torch.empty(n_blocks(ref.region_starts(), ref.nbytes), dtype=torch.int64)
table = flatten_table(((gather_addresses(ts.values(), cpu), tuple(m.nbytes for m in ref.metas),
                        tuple(ref.region_starts()), ref.nbytes, out.data_ptr(), s.data_ptr()),), cpu)
copy_sum_blocks(table, BLOCK_WORDS, src_base=0, dst_base=0, sums_base=0)
print("GATHER", torch.equal(out.view(torch.uint8), ref.buffer),
      s.numpy().view(np.uint64).tolist() == _brute_block_sums(ref.buffer, ref.region_starts()))
# the trainer's flatten of a whole version in one launch (three buckets), equal to the CPU flatten
import pickle
from kimi_core.sync.version_layout import flatten_version
got, lay = flatten_version(ts, 40 << 10, device=cpu, block_sums=True)
cpu_b = list(iter_buckets(ts, 40 << 10, checksum=False))
# the layout (built once, cached) carries exactly the buckets' metadata for a receiver
print("LAYOUT", pickle.loads(lay.blob) == [c.metadata() for c in cpu_b],
      flatten_version(ts, 40 << 10, device=cpu, block_sums=True)[1] is lay)
print("FLATTEN", len(got), all(torch.equal(g.buffer, c.buffer) and g.metas == c.metas for g, c in zip(got, cpu_b)),
      all(g.block_sums.numpy().view(np.uint64).tolist() == _brute_block_sums(c.buffer, c.region_starts())
          for g, c in zip(got, cpu_b)))
mixed = _word_tensors(3)  # with "row": its bucket is concatenated on its own, the others gathered in one launch
got = flatten_version(mixed, 40 << 10, device=cpu, block_sums=True)[0]
cpu_b = list(iter_buckets(mixed, 40 << 10, checksum=False))
print("MIXED", len(got) == len(cpu_b) > 1, all(torch.equal(g.buffer, c.buffer) for g, c in zip(got, cpu_b)),
      all(g.block_sums.numpy().view(np.uint64).tolist() == _brute_block_sums(c.buffer, c.region_starts())
          for g, c in zip(got, cpu_b)))
# a version: two buckets into two destinations in one launch, each checked against its own sent sums
parts, dsts, sent = [], [], []
for seed in (5, 6):
    b, st = _regions(seed)
    d = torch.zeros_like(b)
    e = torch.tensor(_brute_block_sums(b, st), dtype=torch.uint64).view(torch.int64)
    parts.append((b.data_ptr(), d.data_ptr(), e.data_ptr(), tuple(st), b.numel()))
    dsts.append((b, d)); sent.append(e)
table, first, _ = version_table(tuple(parts), cpu)
vs, flag = torch.empty(first[-1], dtype=torch.int64), torch.zeros((), dtype=torch.int32)
copy_sum_blocks(table, BLOCK_WORDS, src_base=0, dst_base=0, sums_base=vs.data_ptr(), expect_base=0, flag=flag)
print("VERSION", all(torch.equal(b, d) for b, d in dsts), torch.equal(vs, torch.cat(sent)), "FLAG", int(flag))
sent[1][2] ^= 8
copy_sum_blocks(table, BLOCK_WORDS, src_base=0, dst_base=0, sums_base=vs.data_ptr(), expect_base=0, flag=flag)
print("VFLAG", int(flag))
"""


def test_copy_sum_blocks_kernel_in_triton_interpreter():
    """The Triton kernel itself on the CPU (TRITON_INTERPRET=1): sums equal the brute force, the copy is
    exact, the in-kernel compare raises the flag only on a mismatch, alignment gaps are zero-filled, a
    gather table flattens many tensors into the CPU flatten's exact bytes with the brute-force sums, so does
    the trainer's one launch for all buckets of a version (also beside a bucket it must concatenate), and
    a version table copies and checks several buckets in one launch."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    res = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT, here],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SUMS True COPY True FLAG0 0" in res.stdout and "FLAG1 1" in res.stdout, res.stdout
    assert "GAP [1, 2, 3, 0, 0] 6" in res.stdout, res.stdout
    assert "GATHER True True" in res.stdout and "UNALIGNED None" in res.stdout, res.stdout
    assert "VERSION True True FLAG 0" in res.stdout and "VFLAG 1" in res.stdout, res.stdout
    assert "FLATTEN 3 True True" in res.stdout and "HINTS True" in res.stdout, res.stdout
    assert "MIXED True True True" in res.stdout and "LAYOUT True True" in res.stdout, res.stdout
