"""Rollout routing replay (R3, arXiv 2510.11370) helpers for Kimi MoE layers, on plain tensors.

Facts (``radixark/miles:miles/utils/replay_base.py``,
``miles/backends/training_utils/replay_data.py``, ``miles/backends/megatron_utils/replay_utils.py``):
with ``--use-rollout-routing-replay`` SGLang returns the experts it routed each token to, stored per
sample as ``Sample.rollout_routed_experts``: int32 ``[num_tokens - 1, num_layers, topk]``, padding
``-1``, indexed by the **global** layer id (dense layers included). The trainer wraps the router's
top-k so that the *choice* of experts is replayed while the gate *weights* are recomputed from the
trainer's own router scores (``scores.gather(indices)``); rows that are all ``-1`` (padding tokens)
are filled with ``arange(topk)``.

:func:`replay_route` (``kimi_core.reference.moe``) is that replay for the Kimi/DeepSeek ``noaux_tc`` router of
``kimi_core.reference.moe.route`` (sigmoid scores, bias used only for the choice, optional top-k
renormalisation, ``routed_scaling_factor``); with the router's own choice it reproduces ``route``.
"""

from __future__ import annotations

import numpy as np
import torch

from kimi_core.reference.moe import replay_route  # the replay itself, shared with the reference oracle

__all__ = ["routed_experts_array", "moe_layer_ids", "layer_replay_indices", "replay_route", "replay_overlap"]


def routed_experts_array(flat, num_tokens: int, num_layers: int, topk: int) -> torch.Tensor:
    """Validate/reshape one sample's routed experts to int64 ``[num_tokens - 1, num_layers, topk]``.

    :param flat: array-like of ``(num_tokens - 1) * num_layers * topk`` ints (as SGLang returns them)
        or already shaped.
    :raises ValueError: naming ``rollout_routed_experts`` and the expected shape.
    """
    t = torch.as_tensor(np.asarray(flat)).long()
    want = (num_tokens - 1, num_layers, topk)
    if t.numel() != want[0] * want[1] * want[2]:
        raise ValueError(
            f"rollout_routed_experts has {t.numel()} entries, expected {want} = "
            f"{want[0] * want[1] * want[2]} (num_tokens - 1, num_layers, topk); was the engine "
            "started with the same model and --use-rollout-routing-replay?"
        )
    return t.reshape(want)


def moe_layer_ids(config) -> list[int]:
    """Global ids of the MoE layers of a ``kimi_core.config.KimiConfig`` (the replay streams used)."""
    return [layer for layer in range(config.num_hidden_layers) if config.is_moe_layer(layer)]


def layer_replay_indices(routed: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """``[T, topk]`` replay indices of one layer; all-padding rows become ``arange(topk) % num_experts``.

    :raises ValueError: a non-padding id is outside ``[0, num_experts)``.
    """
    idx = routed[:, layer]
    pad = (idx == -1).all(-1, keepdim=True)
    bad = (idx != -1) & ((idx < 0) | (idx >= num_experts))
    if bad.any():
        raise ValueError(f"rollout_routed_experts layer {layer} holds expert ids outside [0, {num_experts})")
    fill = (torch.arange(idx.shape[-1], device=idx.device) % num_experts).expand_as(idx)
    return torch.where(pad, fill, idx)


def replay_overlap(router_indices: torch.Tensor, replay_indices: torch.Tensor) -> torch.Tensor:
    """Per-token fraction of replayed experts that the trainer's own router also picked: ``[N]`` float.

    1.0 everywhere means rollout and trainer agree on routing; miles' replay check flags tokens with 0.
    """
    hit = (replay_indices.unsqueeze(-1) == router_indices.unsqueeze(-2)).any(-1)
    return hit.float().mean(-1)
