"""Patch ``k3_cpu_build``: the in-tree K3 text model is built on a CPU host (the row is :data:`ENTRY`)."""

from __future__ import annotations

import contextlib

import torch

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "TARGETS", "k3_cpu_construction"]

ENTRY = PatchEntry(
    name="k3_cpu_build",
    target="vllm.models.kimi_k3.nvidia.model.KimiMoE",
    host="vllm",
    versions=">=0.32,<0.33",
    why="the in-tree K3 builds its MoE through vLLM's fused MoE, which has no CPU backend for MXFP4 or SiTU; "
    "maybe_init_gemm_rs_ar imports cutlass (CUDA) when the default-on VLLM_KIMI_K3_GEMM_AR is set; the model "
    "creates CUDA streams and events for overlap",
    how="a context manager, held while our K3 / K3.1 class's upstream __init__ runs on a CPU host, swaps in "
    "kimi_vllm_plugin.models.cpu_moe.KimiK3CpuMoE for KimiMoE, a False-returning maybe_init_gemm_rs_ar and, when "
    "torch has no CUDA, inert torch.cuda.Stream / Event stand-ins; everything is restored on exit, also on error",
    upstream="none; a CPU K3 backend in vLLM would remove it",
    remove_when="vLLM builds K3 on the CPU platform",
    expect="type:type",
)

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
    """Within the block the in-tree K3 builds ``moe_cls`` for its MoE blocks, skips GEMM-AR/RS (its ``cutlass``
    kernels are CUDA-only) and, if torch has no CUDA, gets inert CUDA streams/events (only created for overlap
    at construction). Everything is restored on exit, also on error."""
    import vllm.models.kimi_k3.nvidia.model as k3

    missing = [t for t in TARGETS if not hasattr(k3, t)]
    if missing:
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r}: vllm.models.kimi_k3.nvidia.model.{missing[0]} "
            "is missing; kimi_vllm_plugin/patches/k3_cpu_build.py needs updating"
        )
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
