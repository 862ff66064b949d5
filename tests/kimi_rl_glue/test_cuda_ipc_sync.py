"""CUDA-IPC adapter transport: clear errors without a GPU and for bad manifests; on GPUs (``-m gpu``)
versions through reused buffers arrive byte-exact and a flipped byte is named (timing:
``benchmarks/adapter_sync.py cuda-ipc``)."""

from __future__ import annotations

import hashlib
import pickle
import struct

import pytest
import torch

from kimi_core.lora import Adapter
from kimi_core.sync import AdapterSyncError, AdapterTransport
from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_names_the_cpu_transport():
    with pytest.raises(AdapterSyncError, match="DiskAdapterSync"):
        CudaIpcAdapterSync()


def test_implements_the_protocol():
    """The CUDA-IPC transport has the protocol's publish / receive (checked without a GPU)."""
    assert issubclass(CudaIpcAdapterSync, AdapterTransport)


_HEADER = struct.Struct("<Q16sQ16s?")


def _b2(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _framed(body: bytes, blob: bytes = b"") -> bytes:
    """The documented frame: little-endian u64 body length, BLAKE2b-128 of the body, u64 layout blob length,
    its BLAKE2b-128, bool "digests set"; then the body and the blob."""
    return _HEADER.pack(len(body), _b2(body), len(blob), _b2(blob), True) + body + blob


def _body(manifest: bytes) -> dict:
    return pickle.loads(manifest[_HEADER.size : _HEADER.size + _HEADER.unpack_from(manifest)[0]])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "manifest, match",
    [
        (_framed(b"not a pickle"), "corrupt"),
        (b"x" * 49 + pickle.dumps({"version": 4}), "digest"),
        (_framed(pickle.dumps({"version": 4}), b"not a layout"), "layout"),
        (_framed(pickle.dumps({"version": 4}))[:-3], "digest"),
        (_framed(pickle.dumps({"version": 4}))[:5], "digest"),
        (_framed(pickle.dumps({"version": 3})), "version 3, expected 4"),
    ],
)
def test_bad_or_stale_manifest_is_named(manifest, match):
    with pytest.raises(AdapterSyncError, match=match):
        CudaIpcAdapterSync(0).receive(4, manifest)


def _engine(gpu: int, conn) -> None:
    """Engine process: receive each (manifest, version); answer with the tensors on the CPU, or with the
    error and the last good version's tensors (still the views receive returned)."""
    torch.cuda.set_device(gpu)
    sync, last = CudaIpcAdapterSync(gpu, bucket_bytes=1 << 20), None
    while (msg := conn.recv()) is not None:
        try:
            last = sync.receive(msg[1], msg[0])
            conn.send({k: v.cpu() for k, v in last.tensors.items()})
        except AdapterSyncError as e:
            conn.send((str(e), {k: v.cpu() for k, v in last.tensors.items()}))


@pytest.mark.gpu
@pytest.mark.parametrize("engine_gpu", [0, 1])
def test_versions_through_reused_buffers_arrive_exactly(engine_gpu):
    """Three versions through the trainer's persistent bucket buffers (same IPC handles, mappings kept open
    by the engine) each arrive byte-exact, never a previous version's bytes; a byte flipped after the
    sums is named, and the last good version's tensors stay intact; colocated and across GPUs."""
    import torch.multiprocessing as mp

    if engine_gpu >= torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(engine_gpu, child), daemon=True)
    proc.start()
    trainer = CudaIpcAdapterSync(0, bucket_bytes=1 << 20)
    g = torch.Generator(device="cuda:0").manual_seed(0)
    names = [f"base_model.model.layers.{i}.mlp.up_proj.lora_{ab}.weight" for i in range(6) for ab in "AB"]
    params = {k: torch.empty(96, 1024, dtype=torch.bfloat16, device="cuda:0") for k in names}
    try:
        handles = []
        for version in (1, 2, 3):
            for p in params.values():
                p.normal_(generator=g)  # an optimizer step: same parameters, new values
            manifest, _ = trainer.publish(Adapter(params, {"r": 96}), version)
            handles.append([h[1][7] for h in _body(manifest)["handles"]])
            parent.send((manifest, version))
            got = parent.recv()
            trainer.release(version)
            assert isinstance(got, dict), got
            for k, v in params.items():
                assert torch.equal(got[k], v.cpu()), (version, k)
        assert handles[0] == handles[1] == handles[2]  # the same buffers every step
        good = {k: v.cpu() for k, v in params.items()}  # version 3
        for p in params.values():
            p.normal_(generator=g)
        manifest, _ = trainer.publish(Adapter(params, {"r": 96}), 4)
        b = trainer._live[4][1]
        b.buffer[b.metas[0].offset + 5] ^= 1  # after the sums
        torch.cuda.synchronize()
        parent.send((manifest, 4))
        err, kept = parent.recv()
        assert b.metas[0].name in err, err
        assert all(torch.equal(kept[k], v) for k, v in good.items())  # version 3's buffers untouched
    finally:
        parent.send(None)
        proc.join(timeout=60)


_COPY_VERSION_SCRIPT = r"""
import torch
from kimi_core.sync import BucketChecksumError, iter_buckets
from kimi_core.sync.checksum import copy_block_sums
from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync

def wire(b):  # the bucket's bytes, then its block sums (numpy on the CPU), as the trainer's GPU flatten writes them
    return torch.cat([b.buffer, copy_block_sums(b.buffer, None, b.region_starts()).view(torch.uint8)])

g = torch.Generator().manual_seed(1)
ts = {f"base_model.model.layers.{i}.mlp.up_proj.lora_{ab}.weight": torch.randn(64, 1000, generator=g).bfloat16()
      for i in range(4) for ab in "AB"}
buckets = list(iter_buckets(ts, 300_000, checksum=False))
sync = object.__new__(CudaIpcAdapterSync)  # the engine half only, on the CPU under TRITON_INTERPRET
sync.device = torch.device("cpu")
slot = {}
local = [(type(b).from_parts(torch.zeros(b.nbytes, dtype=torch.uint8), b.metadata(), verify=False), wire(b),
          tuple(b.region_starts())) for b in buckets]
flag = torch.zeros((), dtype=torch.int32)
pending = sync._copy_version(slot, local, flag)
print("BUCKETS", len(buckets), "COPY", all(torch.equal(r.buffer, b.buffer) for (r, _, _), b in zip(local, buckets)),
      "FLAG", int(flag), "PENDING", len(pending))
local[1][1][local[1][0].metas[1].offset + 7] ^= 2  # a byte of bucket 1's second tensor, after its sums
sync._copy_version(slot, local, flag)
names = []
for r, got, sent in sync._copy_version(slot, local, flag):
    try:
        r.check_blocks(got, sent)
    except BucketChecksumError as e:
        names.append(str(e))
print("FLAG2", int(flag), "NAMED", len(names) == 1 and local[1][0].metas[1].name in names[0])
"""


def test_colocated_version_copy_in_triton_interpreter():
    """The colocated receive's one launch per version (``_copy_version``), on the CPU under
    TRITON_INTERPRET=1: every bucket's bytes copied exactly, the flag clear; a byte flipped in one sent
    bucket raises the flag and the block sums name that bucket's tensor."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(
        [sys.executable, "-c", _COPY_VERSION_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "COPY True FLAG 0 PENDING" in res.stdout and "FLAG2 1 NAMED True" in res.stdout, res.stdout
    assert "BUCKETS 1 " not in res.stdout, res.stdout  # several buckets in the one launch
