"""Every Kimi routed-expert shape (K2.x / K2.5 / K3 / K3.1, fc1 / gate / fc2, expert TP 1, 2, 4, 8, MXFP4 and INT4)
gets from the dispatcher a path whose constraints it meets, written out here from the kernels' memory layouts (TMA's
16-byte rows and whole K steps for Gluon, the permuted fused kernels' K steps), not read from the code under test; no
shape falls to the chunked fallback."""

from __future__ import annotations

import pytest
import torch

from kimi_core import kernels
from kimi_core.kernels.w4a16 import dispatch
from kimi_core.kernels.w4a16.expert_shapes import EXPERT_TP, LOCAL_EXPERTS, expert_shapes
from kimi_core.kernels.w4a16.gluon.launch import forward_scales
from kimi_core.kernels.w4a16.gluon.tiles import shape_fits
from kimi_core.quant.formats import INT4, MXFP4

TOKENS = (8, 128, 512, 2048)


def gluon_layout_ok(op: str, N: int, K: int, fmt) -> bool:
    """The Gluon kernels' needs, from their TMA boxes: whole 64-wide K steps; 16-byte rows of the activation (``x``
    ``[T, K]`` bf16 forward, ``dy`` ``[T, N]`` bf16 dgrad) and of the packed bytes (``K / 2`` per weight row); the
    forward's scale rows as the launcher hands them to TMA (padded where ``K / 32`` scales are no multiple of 16
    bytes) at a 16-byte stride, holding the scales unchanged."""
    ws = torch.arange(2 * 8 * (K // 32)).reshape(2, 8, K // 32).to(fmt.scale_dtype)  # [E, N, K / 32]
    rows = forward_scales(ws)
    scales_ok = rows.stride(0) * rows.element_size() % 16 == 0 and torch.equal(rows, ws.reshape(16, K // 32))
    return K % 64 == 0 and (2 * (K if op == "fwd" else N)) % 16 == 0 and (K // 2) % 16 == 0 and N % 8 == 0 and scales_ok


def fused_permuted(op: str, K: int) -> bool:
    """The permuted fused kernels (the fast ones): 128-wide K steps forward, 256-wide output blocks in the dgrad."""
    return K % (128 if op == "fwd" else 256) == 0


def test_the_shapes_are_the_releases():
    """K2.x / K2.5 read 7168 wide with 2048-wide experts; K3 / K3.1 read the 3584 latent with 3072-wide experts;
    every family at expert TP 1, 2, 4, 8, three projections each."""
    shapes = expert_shapes()
    assert len(shapes) == 4 * len(EXPERT_TP) * 3 and set(LOCAL_EXPERTS) == {s.family for s in shapes}
    by = {(s.family, s.proj, s.etp): (s.N, s.K) for s in shapes}
    assert by["k2", "fc1", 1] == (4096, 7168) and by["k25", "fc2", 8] == (7168, 256)
    assert by["k3", "fc1", 2] == (3072, 3584) and by["k31", "fc2", 8] == (3584, 384)
    assert by["k3", "gate", 8] == (384, 3584)


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("fmt", [MXFP4, INT4], ids=["mxfp4", "int4"])
@pytest.mark.parametrize("shape", expert_shapes(), ids=lambda s: s.name.replace(" ", "-"))
def test_every_expert_shape_gets_a_path_it_fits(monkeypatch, shape, fmt, op):
    """At 8 tokens per expert the fused kernels (decode-bound: the 4-bit weights are read once), permuted except where
    the dgrad's ``K`` is no multiple of 256 (K3 fc2 at expert TP 8, K = 384: the plain fused dgrad); from 128 tokens
    per expert the Gluon kernels, whose layout needs every Kimi shape meets; never the chunked fallback."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "gluon_fits", shape_fits)  # as on a Triton with Gluon
    monkeypatch.delenv(kernels.PATH_ENV, raising=False)
    E = LOCAL_EXPERTS[shape.family]
    for tpe in TOKENS:
        path = kernels.choose_path(op, E * tpe, E, shape.N, shape.K, torch.device("cuda:0"))
        assert path != "chunked", (shape, tpe)
        if tpe < 128:
            assert path == "fused", (shape, tpe)
            if not fused_permuted(op, shape.K):  # the one exclusion, named
                assert (shape.family in ("k3", "k31"), shape.proj, shape.etp, op) == (True, "fc2", 8, "dgrad")
        else:
            assert path == "gluon" and gluon_layout_ok(op, shape.N, shape.K, fmt), (shape, tpe)
