"""The attention-residual bank across layers and pipeline stages, packed into one tensor.

Megatron-Core moves exactly one activation tensor between layers (``TransformerBlock``) and
between pipeline stages (p2p send/recv). K3's residual state is ``(prefix, bank)``: the running
block sum and the ``N`` snapshots taken so far (``kimi_core.reference.attn_res``). Both travel
concatenated along the hidden dimension::

    packed = [bank_0 | bank_1 | ... | bank_{N-1} | prefix]      [S, B, (N+1)*H]

so the stock ``TransformerBlock``/``GPTModel`` carry it unchanged. ``N`` at the input of global
layer ``l`` (0-based) is ``ceil(l / block)``; the width of a stage boundary therefore depends on
the stage (:func:`boundary_hidden_size`). megatron's own p2p schedule assumes ``[S, B, hidden_size]``
unless ``variable_seq_lengths=True`` (shapes are sent first), and megatron-core refuses that
flag with the allgather dispatcher ("Token dispatcher type: allgather does not support variable
sequence length"), so K3 with PP > 1 under megatron's schedule needs ``--variable-seq-lengths``
and ``--moe-token-dispatcher-type alltoall`` (GPU). The CPU tests drive the two stages with an
explicit send/recv of the packed tensor (``tests/kimi_megatron_plugin/mp_worker.py``).
"""

from __future__ import annotations

import torch

__all__ = ["pack_bank", "unpack_bank", "num_snapshots_before", "boundary_hidden_size"]


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
