"""Sequence parallelism (``--sequence-parallel``, TP > 1) for the Kimi modules: where the sequence is sharded.

Between modules (embeddings out, residual stream, the norms, K3's attention-residual bank, the router and the
routed experts) every TP rank holds its ``1/tp`` of the tokens, ``[S/tp, B, H]`` (packed: ``[T/tp, 1, H]``), as in
megatron. Each Kimi mixing module (:class:`~.layers.KimiMLA`, :class:`~.layers.KimiKDA`, :class:`~.mlp.KimiMLP`,
the shared experts and K3's latent projections) gathers the sequence once at its entry (:func:`gather_tokens`) and
returns its output's own rows (:func:`scatter_tokens`); the megatron linears inside it are built without sequence
parallelism (:func:`without_sequence_parallel`): full sequence in, input gradient all-reduced over TP (column),
output all-reduced (row). That is the contract the LoRA hooks on those linears compute their deltas under (a delta
is a function of the linear's own input), and it costs one all-gather per module rather than one per linear.

Gradients: the entry gather's backward keeps this rank's rows (every consumer inside the module returns a complete
input gradient, summed over TP by its linear); the exit scatter's backward all-gathers the output gradient. A
replicated parameter that sees only this rank's rows (the norms, the attention-residual weights) has a partial
gradient, marked ``param.sequence_parallel = True`` (:func:`mark_sequence_parallel`) so that megatron-core's
``finalize_model_grads`` sums it over TP (``_allreduce_non_tensor_model_parallel_grads``), as it does for its own
norms and router.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "sequence_parallel_group",
    "gather_tokens",
    "scatter_tokens",
    "without_sequence_parallel",
    "mark_sequence_parallel",
]


def sequence_parallel_group(config):
    """The TP group when ``config.sequence_parallel`` and TP > 1 (the hidden states are sequence-sharded), else
    None."""
    if not getattr(config, "sequence_parallel", False):
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return group if group.size() > 1 else None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """``[S/tp, ...]`` -> ``[S, ...]`` (dim 0, rank order) over ``group``; identity when ``group`` is None.

    Backward keeps this rank's rows of the gradient (no sum): every consumer must hand back a gradient that is
    already complete and the same on every TP rank (a non-sequence-parallel column-parallel linear's all-reduced
    input gradient, a frozen no-grad path)."""
    if group is None:
        return x
    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)


def scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """``[S, ...]`` (the same on every TP rank) -> this rank's ``[S/tp, ...]`` rows; backward all-gathers the
    gradient. Identity when ``group`` is None."""
    if group is None:
        return x
    if x.shape[0] % group.size():
        raise ValueError(
            f"kimi_megatron_plugin: --sequence-parallel splits {x.shape[0]} tokens over "
            f"--tensor-model-parallel-size {group.size()}; pad the sequence (packed: the batch) to a multiple"
        )
    return scatter_to_sequence_parallel_region(x, group=group)


def without_sequence_parallel(config):
    """A shallow copy of the megatron ``config`` with ``sequence_parallel=False`` (the linears inside a module that
    gathered its sequence), or ``config`` itself when it is already off."""
    if not getattr(config, "sequence_parallel", False):
        return config
    out = copy.copy(config)
    out.sequence_parallel = False
    return out


def mark_sequence_parallel(params, config) -> None:
    """Mark replicated ``params`` that see only this rank's tokens (``sequence_parallel = True`` when the config
    has sequence parallelism), megatron's flag for summing their gradients over TP."""
    flag = bool(getattr(config, "sequence_parallel", False))
    for p in params:
        p.sequence_parallel = flag
