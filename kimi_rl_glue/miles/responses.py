"""Response-aligned slices of a miles training batch (what a custom loss receives), without miles.

miles packs a micro-batch as ``logits [1, sum(total_lengths), V]`` (``qkv_format="thd"``) or
``[B, max_seq_len, V]`` (``"bshd"``); the logits at position ``j`` predict token ``j + 1``, so the
response of a sample with ``total`` tokens of which ``resp`` are the response is predicted by
positions ``[end - resp - 1, end - 1)`` (facts: ``radixark/miles:miles/backends/training_utils/
loss_hub/logit_processors.py:get_responses``). Per-token batch entries (``advantages``,
``log_probs``, ``rollout_log_probs``, ``loss_masks``) are lists of ``[resp]`` tensors.

Only context-parallel size 1 and unsharded vocabulary are handled here; :func:`check_unsharded`
raises when miles runs with CP or TP > 1.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["check_unsharded", "iter_response_logits", "cat_field", "pad_ragged", "unpad"]


def check_unsharded(what: str) -> None:
    """Raise NotImplementedError if miles is importable and runs with TP or CP > 1 (our slicing assumes 1)."""
    try:
        from miles.backends.training_utils.parallel import get_parallel_state
    except ImportError:
        return
    try:
        ps = get_parallel_state()
        tp, cp = ps.tp.size, ps.cp.size
    except Exception:  # noqa: BLE001 - no Megatron parallel state (unit use): nothing is sharded
        return
    if tp > 1 or cp > 1:
        raise NotImplementedError(
            f"{what} slices full-vocabulary logits itself and supports --tensor-model-parallel-size 1 and "
            f"--context-parallel-size 1 only (got TP={tp}, CP={cp}); with TP/CP use miles' built-in "
            "--loss-type score_centering (newer miles) or kimi_rl_glue.miles.losses.dapo_loss"
        )


def iter_response_logits(args, batch: dict, logits: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(logits [resp, V], tokens [resp] int64)`` per sample, temperature applied.

    :param args: reads ``qkv_format`` (default ``"thd"``) and ``rollout_temperature`` (default 1).
    :param batch: needs ``unconcat_tokens``, ``total_lengths``, ``response_lengths``; ``max_seq_lens``
        for ``bshd``.
    """
    qkv = getattr(args, "qkv_format", "thd")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [1, T, V] (thd) or [B, S, V] (bshd), got {tuple(logits.shape)}")
    if qkv == "thd":
        if logits.shape[0] != 1:
            raise ValueError(f"qkv_format='thd' needs logits [1, T, V], got {tuple(logits.shape)}")
        flat = logits[0]
    elif qkv == "bshd":
        flat = logits.reshape(-1, logits.shape[-1])
        if batch.get("max_seq_lens") is None:
            raise ValueError("qkv_format='bshd' needs batch['max_seq_lens']")
    else:
        raise ValueError(f"qkv_format={qkv!r}; expected 'thd' or 'bshd'")
    temp = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    end = 0
    for i, (tokens, total, resp) in enumerate(
        zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], strict=True)
    ):
        if qkv == "thd":
            end += total
        else:
            end = batch["max_seq_lens"][i] * i + total
        start = end - resp
        if start < 1 or end > flat.shape[0]:
            raise ValueError(
                f"sample {i}: response [{start}, {end}) does not fit logits with {flat.shape[0]} "
                "positions (check total_lengths / response_lengths)"
            )
        chunk = flat[start - 1 : end - 1]
        if temp != 1.0:
            chunk = chunk / temp
        yield chunk, torch.as_tensor(tokens)[-resp:].long().to(chunk.device)


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
