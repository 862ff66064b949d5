"""The attention-residual bank across layers and pipeline stages, packed into one tensor.

Megatron-Core moves exactly one activation tensor between layers (``TransformerBlock``) and
between pipeline stages (p2p send/recv). K3's residual state is ``(prefix, bank)``: the running
block sum and the ``N`` snapshots taken so far (``kimi_core.reference.attn_res``). Both travel
concatenated along the hidden dimension::

    packed = [bank_0 | bank_1 | ... | bank_{N-1} | prefix]      [S, B, (N+1)*H]

so the stock ``TransformerBlock``/``GPTModel`` carry it unchanged. ``N`` at the input of global
layer ``l`` (0-based) is ``ceil(l / block)``; the width of a stage boundary therefore depends on
the stage (:func:`boundary_hidden_size`). megatron's own 1F1B schedule assumes ``[S, B, hidden_size]``
and offers two ways around that, both checked on 2 GPUs (``benchmarks/megatron_trainer.py multi --cases sched``):

* ``variable_seq_lengths=True`` (miles' ``--variable-seq-lengths``): shapes are sent before each
  tensor. megatron-core refuses that flag with the allgather dispatcher ("Token dispatcher type:
  allgather does not support variable sequence length"), so it goes with
  ``--moe-token-dispatcher-type alltoall``;
* the schedule's ``adjust_tensor_shapes_fn`` argument with :func:`bank_tensor_shapes_fn` (fixed
  shapes, any dispatcher).

megatron's schedules allocate on ``"cuda"`` unconditionally, so the CPU tests drive the two stages
with an explicit send/recv of the packed tensor, sized by :func:`bank_tensor_shapes_fn`
(``tests/kimi_megatron_plugin/mp_worker.py``).
"""

from __future__ import annotations

import torch

__all__ = ["pack_bank", "unpack_bank", "num_snapshots_before", "boundary_hidden_size", "bank_tensor_shapes_fn"]


def pack_bank(prefix: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
    """``[S, B, H]`` prefix and N ``[S, B, H]`` snapshots -> ``[S, B, (N+1)*H]`` (prefix last)."""
    return prefix if not bank else torch.cat([*bank, prefix], dim=-1)


def unpack_bank(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Inverse of :func:`pack_bank`: ``(prefix [S, B, H], bank list of N [S, B, H])``."""
    width = packed.shape[-1]
    if width % hidden:
        raise ValueError(f"attention-residual state has width {width}, not a multiple of hidden_size {hidden}")
    parts = list(packed.split(hidden, dim=-1))
    return parts[-1], parts[:-1]


def num_snapshots_before(layer: int, block: int) -> int:
    """Snapshots in the bank at the input of 0-based global ``layer``: ``ceil(layer / block)``."""
    return -(-layer // block)


def boundary_hidden_size(first_layer_of_stage: int, hidden: int, block: int | None) -> int:
    """Last-dim width of the tensor a stage receives when its first layer is ``first_layer_of_stage``."""
    if not block:
        return hidden
    return hidden * (num_snapshots_before(first_layer_of_stage, block) + 1)


def bank_tensor_shapes_fn(model):
    """``adjust_tensor_shapes_fn`` for megatron's non-interleaved 1F1B schedule on this rank's stage.

    ``model``: the stage's ``GPTModel`` from :mod:`kimi_megatron_plugin.models.provider` (``kimi_config``,
    ``decoder.layers`` with global 1-based ``layer_number``). The returned
    ``fn(recv_shapes, send_shapes) -> (recv_shapes, send_shapes)`` replaces the last dim of each
    ``(S, B, hidden_size)`` by the packed width at this stage's input and output; empty shapes
    (``variable_seq_lengths``) pass through. Models without the bank get the shapes unchanged.
    """
    hidden = model.config.hidden_size
    block = model.kimi_config.attn_res_block_size
    layers = model.decoder.layers
    first = layers[0].layer_number - 1 if len(layers) else 0
    end = layers[-1].layer_number if len(layers) else first

    def widen(shapes, layer):
        width = boundary_hidden_size(layer, hidden, block)
        return [tuple(s[:-1]) + (width,) if len(s) else s for s in shapes]

    def adjust(recv_shapes, send_shapes):
        return widen(recv_shapes, first), widen(send_shapes, end)

    return adjust
