"""Patch ``k3_cpu_build``: build the in-tree K3 text model on a CPU host (ledger in ``__init__``)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["k3_cpu_construction", "TARGETS"]

#: module globals of ``vllm.models.kimi_k3.nvidia.model`` swapped during construction
TARGETS = ("KimiMoE", "maybe_init_gemm_rs_ar")


class _NoStream:
    """Inert stand-in for ``torch.cuda.Stream`` / ``torch.cuda.Event`` on a torch without CUDA."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def k3_cpu_construction(moe_cls):
    """Within the block the in-tree K3 builds ``moe_cls`` for its MoE blocks, skips GEMM-AR/RS (its
    ``cutlass`` kernels are CUDA-only) and, if torch has no CUDA, gets inert CUDA streams/events
    (only created for overlap at construction). Everything is restored on exit, also on error."""
    import vllm.models.kimi_k3.nvidia.model as k3

    missing = [t for t in TARGETS if not hasattr(k3, t)]
    if missing:
        raise RuntimeError(f"kimi_vllm_plugin: vllm.models.kimi_k3.nvidia.model.{missing[0]} is missing; the K3 "
                           "CPU construction patch (kimi_vllm_plugin/patches/k3_cpu_build.py) needs updating")
    saved = {t: getattr(k3, t) for t in TARGETS}
    saved_cuda = (torch.cuda.Stream, torch.cuda.Event)
    k3.KimiMoE = moe_cls
    k3.maybe_init_gemm_rs_ar = lambda *args, **kwargs: False
    if not torch.cuda.is_available():
        torch.cuda.Stream = torch.cuda.Event = _NoStream
    try:
        yield
    finally:
        for t, v in saved.items():
            setattr(k3, t, v)
        torch.cuda.Stream, torch.cuda.Event = saved_cuda
