"""Where the Kimi modules put their parameters: the compute device and megatron's tensor-parallel attributes.

Shared by :mod:`~kimi_megatron_plugin.models.layers`, :mod:`~kimi_megatron_plugin.models.mlp`,
:mod:`~kimi_megatron_plugin.models.attn_res` and :mod:`~kimi_megatron_plugin.models.experts`.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

__all__ = ["compute_device", "tp_size_rank", "new_parameter"]


def compute_device():
    """The current CUDA device, or ``"cpu"`` without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def tp_size_rank() -> tuple[int, int]:
    """``(tensor-parallel world size, this rank)`` from megatron's parallel state."""
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())


def new_parameter(
    config, *shape, init: bool = True, partition_dim: int | None = None, dtype=None
) -> torch.nn.Parameter:
    """A ``shape`` parameter on the compute device in ``dtype`` (default ``config.params_dtype``), filled by
    ``config.init_method`` when ``init`` and ``config.perform_initialization``; ``partition_dim`` marks a
    TP-sharded one (megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``)."""
    p = torch.nn.Parameter(torch.empty(*shape, device=compute_device(), dtype=dtype or config.params_dtype))
    if init and config.perform_initialization:
        config.init_method(p)
    if partition_dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, partition_dim, 1
    return p
