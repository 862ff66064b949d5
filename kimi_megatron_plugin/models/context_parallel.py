"""Context parallelism (``--context-parallel-size``) for the Kimi attention layers: layout, gathers, RoPE slice.

Each CP rank holds megatron's load-balanced share of every sequence (:mod:`kimi_core.attention.cp_layout`:
chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``; packed THD batches split each sequence on its own, the
``packed_seq_params`` bounds being the global, padded ones). What crosses ranks:

* MLA: the compressed KV latent (normed ``kv_compressed`` and the rotated ``k_pe``, ``kv_lora_rank + rope`` values
  a token), all-gathered into global order (:func:`gather_sequence`; its backward reduce-scatters the gradient)
  and up-projected for every token; the local queries attend the keys and values at their global positions.
* K3.1's indexer: its keys (frozen: a plain all-gather); the top-k indices are global positions.
* KDA: the inputs of its two sequence mixers (the short conv and the delta-rule recurrence) are gathered and both
  run over the whole sequence on every rank, which keeps its output rows: the conv's left context and the
  recurrent state across chunk boundaries come for free, at ``cp`` times the mixer's compute and activations.

:class:`CPRotary` gives megatron's MLA its rotary table at this rank's global positions (megatron's own slice
builds a pinned CUDA index, which a CPU process cannot).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kimi_core.attention import load_balanced_positions, segment_ids

__all__ = ["CPLayout", "CPRotary", "cp_group", "cp_layout", "gather_sequence", "without_cp"]


def cp_group(pg_collection=None):
    """The context-parallel process group: ``pg_collection.cp`` when given, else megatron's global one."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


class _OneRank:
    """A stand-in process group of one rank (``size() == 1``, ``rank() == 0``), used only while megatron builds."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def without_cp(pg_collection=None):
    """A copy of ``pg_collection`` (default: megatron's global groups) whose ``cp`` is a one-rank stand-in."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups() if pg_collection is None else copy.copy(pg_collection)
    pgs.cp = _OneRank()
    return pgs


@dataclass
class CPLayout:
    """Where this CP rank's tokens sit in the global sequence.

    :ivar positions: ``[T_local]`` int64 global positions of the local tokens, in local order (non-decreasing).
    :ivar order: ``[T_global]`` int64: row ``order[j]`` of the ranks' concatenated tokens is global position ``j``.
    :ivar cu_seqlens: ``[N + 1]`` global (padded) packed bounds, or None for an unpacked ``[S, B]`` batch.
    :ivar seg: ``[T_global]`` segment id of every global token (packed), or None.
    """

    group: object
    size: int
    rank: int
    positions: torch.Tensor
    order: torch.Tensor
    total: int
    cu_seqlens: torch.Tensor | None
    seg: torch.Tensor | None


def cp_layout(local_len: int, cu_seqlens: torch.Tensor | None, device, group) -> CPLayout | None:
    """The layout of a ``local_len``-token shard (``cu_seqlens``: the global packed bounds), or None at CP = 1.

    One host read of the bounds per call; the index tensors are cached per (shape, bounds, device), so the layers of
    one forward share them."""
    size = group.size() if group is not None else 1
    if size <= 1:
        return None
    bounds = None if cu_seqlens is None else tuple(int(b) for b in cu_seqlens.tolist())
    total = local_len * size
    if bounds is not None and bounds[-1] != total:
        raise ValueError(
            f"kimi_megatron_plugin: with --context-parallel-size {size} the packed bounds "
            f"(packed_seq_params.cu_seqlens_q_padded) must end at {total} = {local_len} local tokens x {size} ranks, "
            f"got {bounds[-1]}"
        )
    positions, order, seg = _layout_tensors(size, group.rank(), total, bounds, str(torch.device(device)))
    return CPLayout(group, size, group.rank(), positions, order, total, cu_seqlens, seg)


@functools.lru_cache(maxsize=8)
def _layout_tensors(size: int, rank: int, total: int, bounds: tuple[int, ...] | None, device: str):
    """``(positions [total / size], order [total], seg [total] or None)`` on ``device`` (see :class:`CPLayout`)."""
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int64)

    def where(r):
        if cu is None:
            return load_balanced_positions(size, r, seq_len=total)
        return load_balanced_positions(size, r, cu_seqlens=cu)

    every = torch.cat([where(r) for r in range(size)])
    order = torch.empty_like(every)
    order[every] = torch.arange(total)
    seg = None if cu is None else segment_ids(cu, total).to(device)
    return where(rank).to(device), order.to(device), seg


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over the CP group (rank order); backward reduce-scatters the gradient, so each rank
    gets the sum over ranks of the gradient that flowed into its own rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        local = local.contiguous()
        out = torch.empty((group.size() * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        torch.distributed.all_gather_into_tensor(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        torch.distributed.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_sequence(local: torch.Tensor, layout: CPLayout, dim: int = 0, differentiable: bool = True) -> torch.Tensor:
    """``local`` (its ``dim`` the ``T_local`` tokens of this rank) -> the whole sequence ``T_global`` in global order.

    ``differentiable``: through :class:`_AllGatherSeq` (backward reduce-scatter); else a plain all-gather (frozen
    tensors, e.g. the indexer's keys)."""
    x = local.movedim(dim, 0)
    if differentiable:
        full = _AllGatherSeq.apply(x, layout.group)
    else:
        x = x.contiguous()
        full = torch.empty((layout.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        torch.distributed.all_gather_into_tensor(full, x, group=layout.group)
    return full.index_select(0, layout.order).movedim(0, dim)


class CPRotary(torch.nn.Module):
    """Rotary table of megatron's MLA at this CP rank's global positions.

    Wraps megatron's ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` (or :class:`~.layers._NoRotation`): the full
    table comes from the wrapped module with its own CP slice off (``packed_seq=True``), and for an unpacked batch
    the rows of the local tokens are taken here, the same rows as megatron's ``get_pos_emb_on_this_cp_rank``.
    Packed batches keep the full table: megatron's THD RoPE picks each sequence's rows by the CP rank itself.
    """

    def __init__(self, inner: torch.nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **_):
        out = self.inner(max_seq_len, offset, packed_seq=True)
        emb, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if not packed_seq:
            pos = load_balanced_positions(self.group.size(), self.group.rank(), seq_len=emb.shape[0])
            emb = emb.index_select(0, pos.to(emb.device))
        return emb if rest is None else (emb, *rest)
