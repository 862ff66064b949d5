"""Packing and unpacking of padded token batches, the ``flash_attn.bert_padding`` helpers SkyRL imports.

A padded batch ``[B, S, ...]`` with a mask ``[B, S]`` (nonzero = a real token) becomes the packed tokens
``[N, ...]`` (N = number of real tokens, row-major over batch then position) plus what is needed to undo
it: the flat positions of the real tokens in ``B * S`` and the cumulative sequence lengths that varlen
attention kernels take.
"""

import torch


def index_first_axis(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``values``: ``[M, ...]``, ``[N]`` int64 -> ``[N, ...]`` (differentiable)."""
    return values[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Scatter ``values`` ``[N, ...]`` to rows ``indices`` of a zero ``[first_axis_dim, ...]`` tensor."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the real tokens of a padded batch.

    Args:
        hidden_states: ``[B, S, ...]``, any dtype.
        attention_mask: ``[B, S]``, bool or integer; nonzero marks a token that is used.
        unused_mask: optional ``[B, S]``; nonzero marks a token that is kept in the packed output but not
            counted as used (allocated but unused positions).

    Returns:
        ``(packed [N, ...], indices [N] int64, cu_seqlens [B + 1] int32, max_seqlen int, seqused [B] int32)``
        where the kept tokens are those of ``attention_mask`` or ``unused_mask``, ``indices`` are their flat
        positions in ``B * S``, ``cu_seqlens`` the running sum of kept tokens per sequence starting at 0,
        ``max_seqlen`` the largest kept count, and ``seqused`` the count of used tokens per sequence.
    """
    if attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"unpad_input: attention_mask {tuple(attention_mask.shape)} must be the first two dims of "
            f"hidden_states {tuple(hidden_states.shape)}"
        )
    used = attention_mask != 0
    kept = used if unused_mask is None else used | (unused_mask != 0)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    batch, seqlen = attention_mask.shape
    packed = index_first_axis(hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:]), indices)
    return packed, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Undo ``unpad_input``: ``[N, ...]`` packed tokens and their flat ``indices`` -> ``[batch, seqlen, ...]``.

    Positions not in ``indices`` are zero; the dtype and device of ``hidden_states`` are kept.
    """
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
