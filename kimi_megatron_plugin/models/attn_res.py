"""K3's attention residuals on Megatron-Core: the decoder layer that carries the bank, and the output norm.

The residual state ``(prefix, bank)`` travels between layers and pipeline stages packed into the one
hidden-state tensor megatron moves (:mod:`kimi_megatron_plugin.models.pipeline`); the maths is
:func:`kimi_core.reference.attn_res.attn_res_aggregate`.

* :class:`KimiAttnResLayer` - a ``TransformerLayer`` whose attention and MLP inputs are aggregated from the bank.
* :class:`KimiOutputNorm` - the block's final norm: output aggregator + model norm.

Sequence parallelism: the bank, the aggregation and the norms are per token and run on this TP rank's ``[S/tp]``
rows; their replicated weights are marked ``sequence_parallel`` (megatron sums their gradients over TP).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from kimi_core.reference.attn_res import attn_res_aggregate
from kimi_core.reference.ops import rms_norm
from kimi_megatron_plugin.models.layers import KimiRMSNorm
from kimi_megatron_plugin.models.parameters import compute_device, new_parameter
from kimi_megatron_plugin.models.pipeline import pack_bank, unpack_bank
from kimi_megatron_plugin.models.sequence_parallel import mark_sequence_parallel

__all__ = ["KimiAttnResLayer", "KimiOutputNorm"]


class KimiAttnResLayer(TransformerLayer):
    """K3 decoder layer with the attention-residual bank (``kimi_core.reference.attn_res``).

    ``hidden_states`` is the packed ``[S, B, (N+1)*H]`` tensor of :func:`kimi_megatron_plugin.models.pipeline.pack_bank`
    (N snapshots then the running ``prefix``); the layer returns the packed state after itself.
    Extra replicated parameters: ``self_attention_res_norm.weight [H]``,
    ``self_attention_res_proj.weight [1, H]``, ``mlp_res_norm.weight [H]``, ``mlp_res_proj.weight [1, H]``.
    """

    def __init__(
        self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None, vp_stage=None, kimi=None, **_
    ):
        if (hidden_dropout if hidden_dropout is not None else config.hidden_dropout) != 0:
            raise ValueError("kimi_megatron_plugin: attention residuals need --hidden-dropout 0")
        super().__init__(
            config,
            submodules,
            layer_number=layer_number,
            hidden_dropout=hidden_dropout,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self.kimi = kimi
        self.block = kimi.attn_res_block_size
        H = config.hidden_size
        for n in ("self_attention_res", "mlp_res"):
            setattr(self, f"{n}_norm", KimiRMSNorm(config, H, kimi.rms_norm_eps))
            proj = torch.nn.Module()
            proj.weight = new_parameter(config, 1, H)
            mark_sequence_parallel([proj.weight], config)
            setattr(self, f"{n}_proj", proj)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, **kwargs):
        H, eps = self.config.hidden_size, self.kimi.rms_norm_eps
        layer = self.layer_number - 1  # global, 0-based
        prefix, bank = unpack_bank(hidden_states, H)
        if bank:
            mixed = attn_res_aggregate(
                prefix, bank, self.self_attention_res_norm.weight, self.self_attention_res_proj.weight, eps
            )
            attn_in = self.input_layernorm(mixed)
        else:
            attn_in = self.input_layernorm(prefix)
        if layer % self.block == 0:
            bank = [*bank, prefix]
        # packed sequences (THD): the bank and the aggregation are per token, only attention needs the bounds
        a, _b = self.self_attention(
            attn_in, attention_mask=attention_mask, packed_seq_params=kwargs.get("packed_seq_params")
        )
        prefix = a if layer % self.block == 0 else prefix + a
        mixed = attn_res_aggregate(prefix, bank, self.mlp_res_norm.weight, self.mlp_res_proj.weight, eps)
        m, _b = self.mlp(self.pre_mlp_layernorm(mixed))
        prefix = prefix + m
        return pack_bank(prefix, bank), context


class KimiOutputNorm(torch.nn.Module):
    """The block's final norm for K3: output aggregator over the bank, then the model norm.

    ``forward(packed [S, B, (N+1)*H]) -> [S, B, H]``; parameters ``output_attn_res_norm.weight [H]``,
    ``output_attn_res_proj.weight [1, H]`` and ``weight [H]`` (HF ``model.norm.weight``).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, kimi=None, **_):
        super().__init__()
        self.hidden, self.eps = hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=compute_device(), dtype=config.params_dtype))
        self.output_attn_res_norm = KimiRMSNorm(config, hidden_size, eps)
        self.output_attn_res_proj = torch.nn.Module()
        self.output_attn_res_proj.weight = new_parameter(config, 1, hidden_size)
        mark_sequence_parallel([self.weight, self.output_attn_res_proj.weight], config)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        prefix, bank = unpack_bank(packed, self.hidden)
        out = attn_res_aggregate(
            prefix, bank, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, self.eps
        )
        return rms_norm(out, self.weight, self.eps)
