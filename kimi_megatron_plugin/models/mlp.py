"""The MLP slot of a Kimi layer on Megatron-Core: dense GLU MLP, shared experts, router and the MoE layer.

* :class:`KimiMLP` - dense / shared-expert GLU MLP with SiLU (K2.x) or SiTU (K3).
* :class:`KimiRouter` - megatron-core ``TopKRouter`` (sigmoid + expert bias = ``noaux_tc``) with a frozen bias.
* :class:`KimiMoELayer` - megatron-core ``MoELayer`` (allgather dispatcher, the routed experts of
  :mod:`kimi_megatron_plugin.models.experts`) plus K3's latent projections and post-combine RMSNorm.

The maths comes from :mod:`kimi_core.reference`; activations are ``[S, B, H]`` (sequence first).

Sequence parallelism (:mod:`kimi_megatron_plugin.models.sequence_parallel`): the MLPs gather their ``[S/tp, B, H]``
input and return their own rows; in the MoE layer the router, the dispatcher and the routed experts work on this
rank's tokens (megatron's own sequence-parallel MoE), the shared experts and K3's latent projections on the gathered
sequence.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from kimi_core.reference.ops import glu
from kimi_megatron_plugin.models.layers import KimiRMSNorm, ReplicatedLinear
from kimi_megatron_plugin.models.parameters import tp_size_rank
from kimi_megatron_plugin.models.sequence_parallel import (
    gather_tokens,
    scatter_tokens,
    sequence_parallel_group,
    without_sequence_parallel,
)

__all__ = ["KimiMLP", "KimiSharedMLP", "KimiRouter", "KimiMoELayer"]


class KimiMLP(MegatronModule):
    """GLU MLP ``linear_fc2(act(gate, up))``, ``linear_fc1`` column-parallel ``[2*ffn/tp, in]``.

    The local ``linear_fc1`` rows are ``[gate_shard; up_shard]`` (megatron's GLU layout), so the
    mapping concatenates the rank's slices of HF ``gate_proj`` and ``up_proj``. ``act`` is
    ``kimi_core.reference.ops.glu`` (SiLU for K2.x, SiTU for K3). Returns ``(out, None)``.

    A module of our own rather than megatron's ``MLP``: 0.16.1's ``MLP`` sizes ``linear_fc2`` from
    ``config.ffn_hidden_size`` whatever ``ffn_hidden_size`` it is given, and its GLU cannot express
    SiTU's transform of the linear half.

    Sequence parallelism: ``forward`` gathers the ``[S/tp, B, H]`` input, runs :meth:`forward_full` (linears built
    without sequence parallelism) and returns this rank's rows.
    """

    def __init__(self, config, submodules=None, kimi=None, ffn_hidden_size: int | None = None, tp_group=None, **_):
        super().__init__(config=config)
        self.sp_group = sequence_parallel_group(config)
        config = without_sequence_parallel(config)
        self.kimi = kimi
        ffn = ffn_hidden_size or config.ffn_hidden_size
        tp, _r = tp_size_rank()
        if ffn % tp:
            raise ValueError(f"MLP width {ffn} is not divisible by --tensor-model-parallel-size {tp}")
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    def forward(self, hidden_states, *args, **kwargs):
        out, bias = self.forward_full(gather_tokens(hidden_states, self.sp_group))
        return scatter_tokens(out, self.sp_group), bias

    def forward_full(self, hidden_states):
        """The MLP on the whole sequence ``[S, B, H]`` (every TP rank the same) -> ``([S, B, H], None)``."""
        h = self.linear_fc1(hidden_states)[0]
        gate, up = h.chunk(2, dim=-1)
        return self.linear_fc2(glu(self.kimi, gate, up))


class KimiSharedMLP(KimiMLP):
    """Shared experts: a :class:`KimiMLP` of width ``moe_intermediate_size * n_shared_experts``."""

    def __init__(self, config, submodules=None, kimi=None, pg_collection=None, gate=False, **_):
        if gate:
            raise ValueError(
                "kimi_megatron_plugin: Kimi shared experts have no gate (moe_shared_expert_gate must be False)"
            )
        super().__init__(config, submodules, kimi=kimi, ffn_hidden_size=config.moe_shared_expert_intermediate_size)


class KimiRouter(TopKRouter):
    """``TopKRouter`` whose expert-load counter is updated eagerly.

    megatron-core decorates ``TopKRouter._apply_expert_bias`` with ``jit_fuser`` (``torch.compile``),
    which costs several seconds of compilation on the first CPU forward. Kimi's expert bias is
    fixed (``moe_router_bias_update_rate=0``); the counter is kept for parity with megatron.
    """

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                rm = routing_map if padding_mask is None else routing_map & padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += rm.sum(dim=0).to(self.local_tokens_per_expert.dtype)


class KimiMoELayer(MoELayer):
    """``MoELayer`` with Kimi's routing and K3's latent MoE.

    Megatron pieces kept: ``TopKRouter`` (sigmoid scores, ``expert_bias`` = HF
    ``e_score_correction_bias``, renormalised top-k times ``routed_scaling_factor``: DeepSeek's
    ``noaux_tc``), the allgather token dispatcher over TP x EP, the experts built from the spec
    (:class:`kimi_megatron_plugin.models.experts.KimiExperts`), shared experts (:class:`KimiSharedMLP`).
    Added for K3 (``routed_expert_hidden_size``)::

        z   = routed_expert_down_proj(x)               routing still reads the full x
        y   = combine(experts(dispatch(z)))            experts work in the latent width
        y   = RMSNorm(y; routed_expert_norm)           latent_moe_use_norm, after the combine
        out = routed_expert_up_proj(y) + shared(x)

    megatron's own ``moe_latent_size`` asserts TransformerEngine, so the latent projections are
    replicated modules of ours. ``forward`` composes ``MoELayer``'s steps itself; unlike
    ``MoELayer.forward`` it does not refuse TP > 1 without sequence parallelism in training mode.

    Sequence parallelism: the router, the dispatcher and the routed experts see this rank's ``[S/tp * B]`` tokens
    (megatron's sequence-parallel MoE: with ``expert_tensor_parallel_size`` 1 every TP rank routes its own tokens);
    the shared experts and the latent projections and norm run on the gathered sequence (one gather of ``x`` and one
    of the combined latent output), and the sum is scattered back to this rank's rows.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, kimi=None, **_):
        if kimi.n_group > 1 and kimi.topk_group < kimi.n_group:
            raise NotImplementedError(
                f"config.json: n_group={kimi.n_group}, topk_group={kimi.topk_group}: group-limited routing is not "
                "mapped (megatron scores a group by its top-(k/groups) sum, DeepSeek by its top-2 sum)"
            )
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.kimi = kimi
        self.sp_group = sequence_parallel_group(config)
        lat = kimi.routed_expert_hidden_size
        self.latent = bool(lat)
        if self.latent:
            full = without_sequence_parallel(config)  # they see the gathered sequence
            self.routed_expert_down_proj = ReplicatedLinear(full, config.hidden_size, lat)
            self.routed_expert_up_proj = ReplicatedLinear(full, lat, config.hidden_size)
            self.routed_expert_norm = KimiRMSNorm(full, lat, kimi.rms_norm_eps) if kimi.latent_moe_use_norm else None

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None, **_):
        sp = self.sp_group
        gathered = self.latent or self.shared_experts is not None
        full = gather_tokens(hidden_states, sp) if gathered else hidden_states  # [S, B, H] under SP
        shared = self.shared_experts.forward_full(full)[0] if self.shared_experts is not None else None
        probs, routing_map = self.router(hidden_states)
        x = scatter_tokens(self.routed_expert_down_proj(full), sp) if self.latent else hidden_states
        x, probs = self.token_dispatcher.dispatch_preprocess(x, routing_map, probs)
        x, probs = self.token_dispatcher.token_dispatch(x, probs)
        out, _bias = self.routed_experts_compute(x, probs)
        out = self.token_dispatcher.token_combine(out)
        out = self.token_dispatcher.combine_postprocess(out)  # [S/tp, B, *] under SP
        if self.latent:
            out = gather_tokens(out, sp)
            if self.routed_expert_norm is not None:
                out = self.routed_expert_norm(out)
            out = self.routed_expert_up_proj(out)
            if shared is not None:
                out = out + shared
            return scatter_tokens(out, sp), None
        if shared is not None:
            out = out + scatter_tokens(shared, sp)
        return out, None
