"""CUDA-IPC adapter transport: clear errors without a GPU and for bad manifests; on GPUs (``-m gpu``)
versions through reused buffers arrive byte-exact and a flipped byte is named (timing:
``benchmarks/cuda_ipc_sync.py``)."""

from __future__ import annotations

import pickle
import struct
import zlib

import pytest
import torch

from kimi_core.lora import Adapter
from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync
from kimi_rl_glue.sync.disk import AdapterSyncError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_names_the_cpu_transport():
    with pytest.raises(AdapterSyncError, match="ShmAdapterSync"):
        CudaIpcAdapterSync()


def _framed(body: bytes) -> bytes:
    """The documented frame: little-endian u64 body length, u32 CRC-32 (zlib), bool "CRC set", body."""
    return struct.pack("<QI?", len(body), zlib.crc32(body), True) + body


@pytest.mark.gpu
@pytest.mark.parametrize("manifest, match", [(_framed(b"not a pickle"), "corrupt"),
                                             (b"x" * 13 + pickle.dumps({"version": 4}), "CRC-32"),
                                             (_framed(pickle.dumps({"version": 4}))[:-3], "CRC-32"),
                                             (_framed(pickle.dumps({"version": 4}))[:5], "CRC-32"),
                                             (_framed(pickle.dumps({"version": 3})), "version 3, expected 4")])
def test_bad_or_stale_manifest_is_named(manifest, match):
    with pytest.raises(AdapterSyncError, match=match):
        CudaIpcAdapterSync(0).receive(manifest, 4)


def _engine(gpu: int, conn) -> None:
    """Engine process: receive each (manifest, version) and answer with the tensors on the CPU (or the error)."""
    torch.cuda.set_device(gpu)
    sync = CudaIpcAdapterSync(gpu, bucket_bytes=1 << 20)
    while (msg := conn.recv()) is not None:
        try:
            conn.send({k: v.cpu() for k, v in sync.receive(*msg).tensors.items()})
        except AdapterSyncError as e:
            conn.send(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("engine_gpu", [0, 1])
def test_versions_through_reused_buffers_arrive_exactly(engine_gpu):
    """Three versions through the trainer's persistent bucket buffers (same IPC handles, mappings kept open
    by the engine) each arrive byte-exact, never a previous version's bytes; a byte flipped after the
    sums is named; colocated and across GPUs."""
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
            handles.append([h[1][7] for h in pickle.loads(manifest[13:])["handles"]])
            parent.send((manifest, version))
            got = parent.recv()
            trainer.release(version)
            assert isinstance(got, dict), got
            for k, v in params.items():
                assert torch.equal(got[k], v.cpu()), (version, k)
        assert handles[0] == handles[1] == handles[2]  # the same buffers every step
        manifest, _ = trainer.publish(Adapter(params, {"r": 96}), 4)
        b = trainer._live[4][1]
        b.buffer[b.metas[0].offset + 5] ^= 1  # after the sums
        torch.cuda.synchronize()
        parent.send((manifest, 4))
        err = parent.recv()
        assert isinstance(err, str) and b.metas[0].name in err, err
    finally:
        parent.send(None)
        proc.join(timeout=60)
