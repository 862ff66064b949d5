"""megatron-core's model-parallel state on CPU processes: a gloo process group with the CPU patches applied.

For CI, the CPU demo and the tests (a GPU job keeps its own megatron init)::

    from kimi_megatron_plugin import cpu_parallel
    cpu_parallel.initialize_cpu_parallel(tensor_parallel=1)
    ...
    cpu_parallel.destroy_cpu_parallel()
"""

from __future__ import annotations

import os

import torch

from kimi_megatron_plugin.patches import apply_cpu_shims

__all__ = ["initialize_cpu_parallel", "destroy_cpu_parallel", "cpu_rng_tracker"]

DEFAULT_PORT = 29571


def initialize_cpu_parallel(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> None:
    """gloo process group + megatron's model-parallel groups on CPU, with ``cpu_current_device`` applied.

    ``rank`` / ``world_size`` default to the ``RANK`` / ``WORLD_SIZE`` environment (torchrun) or 0 / 1;
    ``port`` (default :data:`DEFAULT_PORT`) is used when ``MASTER_PORT`` is unset. Expert tensor parallelism
    is 1 (whole experts per rank). ``context_parallel`` > 1: each rank then feeds its load-balanced share of every
    sequence (:mod:`kimi_core.attention.cp_layout`). Without CUDA, megatron's RNG tracker is its no-op one
    (:func:`cpu_rng_tracker`), so sequence parallelism (``sequence_parallel=True`` in the model config) runs.
    """
    apply_cpu_shims()
    if not torch.cuda.is_available():
        cpu_rng_tracker()
    from megatron.core import parallel_state

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port or DEFAULT_PORT))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        context_parallel_size=context_parallel,
        expert_tensor_parallel_size=1,
    )


def destroy_cpu_parallel() -> None:
    """Tear down what :func:`initialize_cpu_parallel` set up (megatron's groups, then the process group)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cpu_rng_tracker() -> None:
    """Install megatron-core's no-op RNG tracker (``initialize_rng_tracker(inference_rng_tracker=True)``).

    Under sequence parallelism megatron forks its model-parallel CUDA RNG around the dropout of the sequence-parallel
    regions (the embedding, the block: ``Exception: cuda rng state model-parallel-rng is not added`` otherwise);
    a CPU process has no CUDA generator. The Kimi configs have no dropout (``hidden_dropout`` 0, checked by the
    attention-residual layer), so nothing random happens inside those forks."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
