"""Which backend runs a W4A16 grouped GEMM: the dispatch tables, as data, and :func:`choose_path`, which reads them.

Paths: ``"fused"`` (:mod:`.fused`, the weights decoded in registers; off CUDA the naive twin :mod:`.naive`),
``"chunked"`` (:mod:`.chunked`, a few experts decoded into a bounded bf16 workspace, then ``torch._grouped_mm``)
and ``"gluon"`` (:mod:`.gluon`, Hopper only, the weights decoded into the wgmma's register fragment). The tables are
keyed per op (``"fwd"``, ``"dgrad"``); their ``"default"`` rows apply to every shape whose constraints the path meets
(:func:`gluon_fits`, :func:`.chunked.fits`), an ``(N, K)`` weight-shape key overrides ``"default"`` for a measured
exception. ``benchmarks/w4a16.py table`` measures every path on the benchmark shapes and ``benchmarks/w4a16.py
launch`` the dispatcher's pick on every Kimi expert shape (:mod:`.expert_shapes`).
"""

from __future__ import annotations

import os

import torch

from kimi_core.kernels.device import device_capability
from kimi_core.kernels.w4a16.chunked import fits as chunked_fits

__all__ = [
    "FUSED_OPTIONS",
    "GLUON_OPTIONS",
    "PATHS",
    "PATH_ENV",
    "W4A16_CROSSOVER",
    "W4A16_GLUON",
    "choose_path",
    "forced_path",
    "gluon_fits",
]

PATH_ENV = "KIMI_W4A16_PATH"
PATHS = ("fused", "chunked", "gluon", "auto")

#: From this mean number of tokens per expert (``T / E``) on, ``"chunked"`` is chosen over ``"fused"`` (where the
#: Gluon kernels do not take the shape or their range excludes it).
# measured: docs/performance.md#w4a16-dispatch
W4A16_CROSSOVER: dict[str, dict] = {"fwd": {"default": 512}, "dgrad": {"default": 512}}

#: Where auto picks ``"gluon"``: a half-open range ``(from, to)`` of mean tokens per expert (``to`` None: no upper
#: end), or None (never). ``"default"`` holds for every shape the Gluon kernels take (:func:`gluon_fits`, a rule from
#: their constraints, not a list of shapes); an ``(N, K)`` key overrides it for one measured shape.
# measured: docs/performance.md#w4a16-dispatch
W4A16_GLUON: dict[str, dict] = {op: {"default": (128, None)} for op in ("fwd", "dgrad")}

#: Keyword arguments the ``"gluon"`` path passes to :func:`.gluon.grouped_gemm` / :func:`.gluon.grouped_gemm_dgrad`.
# measured: docs/performance.md#w4a16-launch-plans
GLUON_OPTIONS: dict[str, dict] = {
    op: {"persistent": True, "decode_ahead": "auto", "fold_scales": True} for op in ("fwd", "dgrad")
}

#: Keyword arguments the ``"fused"`` path passes to :func:`.fused.grouped_gemm` / :func:`.fused.grouped_gemm_dgrad`.
# measured: docs/performance.md#w4a16-launch-plans
FUSED_OPTIONS: dict[str, dict] = {op: {"fold_scales": True} for op in ("fwd", "dgrad")}


def forced_path(path: str | None) -> str:
    """``path`` if given, else ``$KIMI_W4A16_PATH``, else ``"auto"``; refuses anything outside :data:`PATHS`."""
    chosen = path if path is not None else (os.environ.get(PATH_ENV, "").strip() or "auto")
    if chosen not in PATHS:
        src = "path" if path is not None else PATH_ENV
        raise ValueError(f"kimi_core/kernels/w4a16: {src} must be one of {', '.join(PATHS)}, got {chosen!r}")
    return chosen


def gluon_fits(N: int, K: int) -> bool:
    """Whether the Gluon kernels take ``[N, K]`` experts in either format (:func:`.gluon.tiles.shape_fits`: ``K`` a
    multiple of 64, ``N`` of 8) and this Triton has Gluon to run them."""
    from kimi_core.kernels.w4a16.gluon.pipeline import HAVE_GLUON
    from kimi_core.kernels.w4a16.gluon.tiles import shape_fits

    return HAVE_GLUON and shape_fits(N, K)


def choose_path(op: str, T: int, E: int, N: int, K: int, device, path: str | None = None) -> str:
    """``"fused"``, ``"chunked"`` or ``"gluon"`` for one grouped GEMM of ``T`` rows over ``E`` experts of
    ``[N, K]``.

    :param op: ``"fwd"`` or ``"dgrad"`` (rows of :data:`W4A16_CROSSOVER` and :data:`W4A16_GLUON`).
    :param device: where the operands live; ``"fused"`` on a CPU means the naive twin.
    :param path: ``"fused"`` / ``"chunked"`` / ``"gluon"`` forces a path; ``"auto"`` or ``None`` (then
        ``$KIMI_W4A16_PATH``, default ``auto``) asks the tables, on a CUDA device of compute capability 9.0+ only:
        ``"gluon"`` where ``T / E`` lies in :data:`W4A16_GLUON`'s range for ``(N, K)``, the shape suits the
        Gluon kernels (:func:`gluon_fits`) and the device is a Hopper (compute capability 9.x: wgmma), else
        ``"chunked"`` when one expert fits the workspace bound and ``T / E`` reaches :data:`W4A16_CROSSOVER`, else
        ``"fused"``.
    """
    forced = forced_path(path)
    if forced != "auto":
        return forced
    device = torch.device(device)
    if device.type != "cuda" or E == 0:
        return "fused"
    major = device_capability(device)[0]
    if major < 9:
        return "fused"
    gluon = W4A16_GLUON[op].get((N, K), W4A16_GLUON[op]["default"])
    in_range = gluon is not None and gluon[0] <= T / E and (gluon[1] is None or T / E < gluon[1])
    if in_range and major == 9 and gluon_fits(N, K):  # wgmma: Hopper only
        return "gluon"
    if not chunked_fits(N, K, op):
        return "fused"
    table = W4A16_CROSSOVER[op]
    return "chunked" if T / E >= table.get((N, K), table["default"]) else "fused"
