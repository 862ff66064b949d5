"""Rollout routing replay (R3) on this plugin's models, through megatron-core's own ``RouterReplay``.

megatron-core (``moe_enable_routing_replay=True``) gives every ``TopKRouter`` (our
``KimiRouter`` too) a ``RouterReplay`` whose ``REPLAY_FORWARD`` action makes the router use given
expert indices while the gate weights still come from its own scores (the bias only chose). This
module feeds it the experts a rollout engine reports per token, in the engines' layout::

    routed_experts  int [B, T, num_hidden_layers, k]   global layer ids; dense layers ignored

    with replay_routing(model, routed_experts):
        logits = model(ids, pos, attention_mask=None)

megatron's routers see tokens sequence-major (``[S, B, H]`` flattened), so layer ``i`` gets
``routed_experts[:, :, i]`` transposed to ``[T * B, k]``. Under context parallelism a rank passes the rows of its
own tokens (``routed_experts[:, positions]``, the same split as its input ids). Under sequence parallelism (TP > 1)
every TP rank still passes the rows of all its (CP-local) tokens, as it passes its input ids; each router sees only
its TP rank's ``1/tp`` of them (megatron's sequence split: rows ``[r * T/tp, (r + 1) * T/tp)``), and gets those rows.
The oracle is ``kimi_core.reference``'s ``forward(..., routed_experts=)``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["replay_routing"]


@contextlib.contextmanager
def replay_routing(model, routed_experts: torch.Tensor | None):
    """Replay ``routed_experts`` (see the module docstring) in every MoE layer of ``model`` (a
    ``GPTModel`` built by :mod:`kimi_megatron_plugin.models.provider` with ``moe_enable_routing_replay=True``)
    for the forward passes inside the block; ``None`` leaves routing alone."""
    if routed_experts is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    kimi = model.kimi_config
    k = kimi.num_experts_per_tok
    if routed_experts.ndim != 4 or routed_experts.shape[2:] != (kimi.num_hidden_layers, k):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)}, expected (batch, tokens, "
            f"num_hidden_layers={kimi.num_hidden_layers}, num_experts_per_tok={k})"
        )
    bad = (routed_experts < 0) | (routed_experts >= kimi.n_routed_experts)
    rows = _sequence_parallel_rows(model, routed_experts.shape[1])
    replays = []
    try:
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue
            replay = getattr(router, "router_replay", None)
            if replay is None:
                raise ValueError(
                    "replay_routing: the model was built without moe_enable_routing_replay=True "
                    "(pass it to kimi_megatron_plugin.models.provider.build_model_from_hf)"
                )
            i = layer.layer_number - 1  # global, 1-based in megatron
            if bad[:, :, i].any():
                raise ValueError(f"routed_experts layer {i} holds expert ids outside [0, {kimi.n_routed_experts})")
            replay.set_target_indices(routed_experts[:, rows, i].transpose(0, 1).reshape(-1, k).long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            replays.append(replay)
        yield
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


def _sequence_parallel_rows(model, tokens: int) -> slice:
    """The token rows this TP rank's routers see: all of them, or its ``1/tp`` under sequence parallelism."""
    if not getattr(model.config, "sequence_parallel", False):
        return slice(None)
    from megatron.core import parallel_state

    tp, r = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if tp == 1:
        return slice(None)
    if tokens % tp:
        raise ValueError(
            f"routed_experts has {tokens} tokens a row, not a multiple of --tensor-model-parallel-size {tp} "
            "(--sequence-parallel splits them evenly)"
        )
    m = tokens // tp
    return slice(r * m, (r + 1) * m)
