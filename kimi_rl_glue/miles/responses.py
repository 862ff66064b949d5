"""Response-aligned slices of a miles training batch (what a custom loss receives), without miles.

miles packs a micro-batch as ``logits [1, sum(total_lengths), V]`` (``qkv_format="thd"``) or
``[B, max_seq_len, V]`` (``"bshd"``); the logits at position ``j`` predict token ``j + 1``, so the
response of a sample with ``total`` tokens of which ``resp`` are the response is predicted by
positions ``[end - resp - 1, end - 1)`` (facts: ``radixark/miles:miles/backends/training_utils/
loss_hub/logit_processors.py:get_responses``). Per-token batch entries (``advantages``,
``log_probs``, ``rollout_log_probs``, ``loss_masks``, ``rollout_topk_*``) are lists of full ``[resp]``
(or ``[resp, K]``) tensors on every rank.

Sharding (:class:`ShardLayout`, read from miles' parallel state by :func:`current_layout`):

- tensor parallelism: the last dim of ``logits`` is this rank's vocabulary slice ``V / tp``
  (:mod:`kimi_rl_glue.miles.vocab_parallel` gathers log-probs from it);
- context parallelism, miles' default "zigzag" layout: each sample is cut into ``2 * cp`` chunks of
  ``ceil(total / (2 cp))`` positions (``max_seq_len`` for bshd); rank ``r`` holds chunks ``r`` and
  ``2 cp - 1 - r``, one sample after the other (``cp_utils.get_logits_and_tokens_offset_with_cp``);
- context parallelism with ``--allgather-cp`` (DSA models): the packed sequence is split into ``cp``
  contiguous pieces of equal length, rank ``r`` holds piece ``r``.

:func:`iter_local_responses` yields, per sample, the response rows this rank holds and their indices
into the full ``[resp]`` response, so per-token batch entries are indexed with them; the local order is
the order in which miles' ``sum_of_sample_mean`` under CP expects the per-token values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "ShardLayout",
    "current_layout",
    "iter_local_responses",
    "iter_response_logits",
    "cat_field",
    "pad_ragged",
    "unpad",
]


@dataclass(frozen=True)
class ShardLayout:
    """How the logits a miles loss receives are sharded; the default is unsharded.

    :param tp_group: tensor-parallel process group (``None`` when ``tp_size == 1``).
    :param allgather_cp: miles' ``--allgather-cp`` contiguous CP split instead of the zigzag one.
    """

    tp_group: object = None
    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    allgather_cp: bool = False


def current_layout(args) -> ShardLayout:
    """The layout of this process from miles' parallel state; unsharded when miles or Megatron is not up."""
    try:
        from miles.backends.training_utils.parallel import get_parallel_state
    except ImportError:
        return ShardLayout()
    try:
        ps = get_parallel_state()
        tp, cp = ps.tp, ps.cp
        return ShardLayout(
            tp_group=tp.group if tp.size > 1 else None,
            tp_size=int(tp.size),
            tp_rank=int(tp.rank) if tp.size > 1 else 0,
            cp_size=int(cp.size),
            cp_rank=int(cp.rank) if cp.size > 1 else 0,
            allgather_cp=bool(getattr(args, "allgather_cp", False)),
        )
    except Exception:  # noqa: BLE001 - no Megatron parallel state (unit use): nothing is sharded
        return ShardLayout()


def _flat(args, batch: dict, logits: torch.Tensor) -> tuple[str, torch.Tensor]:
    qkv = getattr(args, "qkv_format", "thd")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [1, T, V] (thd) or [B, S, V] (bshd), got {tuple(logits.shape)}")
    if qkv == "thd":
        if logits.shape[0] != 1:
            raise ValueError(f"qkv_format='thd' needs logits [1, T, V], got {tuple(logits.shape)}")
        return qkv, logits[0]
    if qkv == "bshd":
        if batch.get("max_seq_lens") is None:
            raise ValueError("qkv_format='bshd' needs batch['max_seq_lens']")
        return qkv, logits.reshape(-1, logits.shape[-1])
    raise ValueError(f"qkv_format={qkv!r}; expected 'thd' or 'bshd'")


def _local_positions(
    qkv: str, batch: dict, layout: ShardLayout, n_rows: int
) -> Iterator[tuple[int, list[int], list[int]]]:
    """Per sample: ``(prompt_length, local logit rows, response rows)`` (two equal-length int lists)."""
    cp, r = layout.cp_size, layout.cp_rank
    end = 0
    for i, (total, resp) in enumerate(zip(batch["total_lengths"], batch["response_lengths"], strict=True)):
        total, resp = int(total), int(resp)
        prompt = total - resp
        if prompt < 1:
            raise ValueError(f"sample {i}: response_length {resp} leaves no prompt token in total_length {total}")
        first, last = prompt - 1, total - 1  # global logit positions predicting the response: [first, last)
        if cp == 1:
            base = int(batch["max_seq_lens"][i]) * i if qkv == "bshd" else end
            end = base + total
            if base + total > n_rows:
                raise ValueError(
                    f"sample {i}: response [{base + prompt}, {base + total}) does not fit logits with {n_rows} "
                    "positions (check total_lengths / response_lengths)"
                )
            pos = list(range(first, last))
            yield prompt, [base + p for p in pos], [p - first for p in pos]
        elif layout.allgather_cp:
            if qkv != "thd":
                raise ValueError("--allgather-cp lays out packed (thd) sequences only")
            lo, hi = r * n_rows, (r + 1) * n_rows
            pos = [p for p in range(end + first, end + last) if lo <= p < hi]
            yield prompt, [p - lo for p in pos], [p - end - first for p in pos]
            end += total
        else:
            span = int(batch["max_seq_lens"][i]) if qkv == "bshd" else total
            chunk = -(-span // (2 * cp))
            rows, resp_rows = [], []
            for j, c in enumerate((r, 2 * cp - 1 - r)):
                for p in range(max(c * chunk, first), min((c + 1) * chunk, last)):
                    rows.append(end + j * chunk + p - c * chunk)
                    resp_rows.append(p - first)
            end += 2 * chunk
            if end > n_rows:
                raise ValueError(
                    f"sample {i}: its CP-{cp} chunks end at row {end}, the local logits have {n_rows} "
                    "(check total_lengths / response_lengths / the CP layout)"
                )
            yield prompt, rows, resp_rows


def iter_local_responses(
    args, batch: dict, logits: torch.Tensor, layout: ShardLayout | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield ``(logits [n, V_local], tokens [n] int64, rows [n] int64)`` per sample, temperature applied.

    ``n`` is the number of this CP rank's response tokens of the sample (all ``resp`` without CP);
    ``rows`` index them in the full response, so ``batch[key][i][rows]`` is the local part of a
    per-token entry.

    :param args: reads ``qkv_format`` (default ``"thd"``) and ``rollout_temperature`` (default 1).
    :param batch: needs ``unconcat_tokens``, ``total_lengths``, ``response_lengths``; ``max_seq_lens``
        for ``bshd``.
    :param layout: default unsharded.
    """
    layout = layout or ShardLayout()
    qkv, flat = _flat(args, batch, logits)
    temp = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    for tokens, (prompt, rows, resp_rows) in zip(
        batch["unconcat_tokens"], _local_positions(qkv, batch, layout, flat.shape[0]), strict=True
    ):
        idx = torch.tensor(rows, dtype=torch.long, device=flat.device)
        where = torch.tensor(resp_rows, dtype=torch.long)
        chunk = flat.index_select(0, idx)
        if temp != 1.0:
            chunk = chunk / temp
        toks = torch.as_tensor(tokens).long()[prompt + where]
        yield chunk, toks.to(chunk.device), where.to(chunk.device)


def iter_response_logits(args, batch: dict, logits: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Unsharded :func:`iter_local_responses`: ``(logits [resp, V], tokens [resp] int64)`` per sample."""
    for chunk, tokens, _rows in iter_local_responses(args, batch, logits):
        yield chunk, tokens


def cat_field(batch: dict, key: str, device=None, dtype=None) -> torch.Tensor:
    """``torch.cat`` of the per-sample list ``batch[key]``; KeyError names the key when it is missing."""
    if batch.get(key) is None:
        raise KeyError(f"miles batch has no {key!r} (needed by this loss; check the rollout flags)")
    return torch.cat([torch.as_tensor(x).to(device=device, dtype=dtype) for x in batch[key]])


def pad_ragged(flat: torch.Tensor, lengths: list[int], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat [sum(lengths), *]`` -> ``(padded [B, max_len, *], mask [B, max_len] bool)``."""
    B, R = len(lengths), max(lengths, default=0)
    out = flat.new_full((B, R, *flat.shape[1:]), fill)
    mask = torch.zeros(B, R, dtype=torch.bool, device=flat.device)
    for i, piece in enumerate(flat.split(list(lengths))):
        out[i, : piece.shape[0]] = piece
        mask[i, : piece.shape[0]] = True
    return out, mask


def unpad(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_ragged`: valid entries in row order, ``[sum(lengths), *]``."""
    return padded[mask]
