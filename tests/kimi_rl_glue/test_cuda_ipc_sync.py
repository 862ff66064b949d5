"""CUDA-IPC adapter transport: clear errors without a GPU and for bad manifests (the GPU path itself is
exercised by ``benchmarks/cuda_ipc_sync.py`` on 2 H200s: bytes equal, flipped byte named)."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import torch

from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync
from kimi_rl_glue.sync.disk import AdapterSyncError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_names_the_cpu_transport():
    with pytest.raises(AdapterSyncError, match="ShmAdapterSync"):
        CudaIpcAdapterSync()


def _framed(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest() + body


@pytest.mark.gpu
@pytest.mark.parametrize("manifest, match", [(_framed(b"not a pickle"), "corrupt"),
                                             (b"x" * 16 + pickle.dumps({"version": 4}), "BLAKE2b"),
                                             (_framed(pickle.dumps({"version": 4}))[:-3], "BLAKE2b"),
                                             (_framed(pickle.dumps({"version": 3})), "version 3, expected 4")])
def test_bad_or_stale_manifest_is_named(manifest, match):
    with pytest.raises(AdapterSyncError, match=match):
        CudaIpcAdapterSync(0).receive(manifest, 4)
