"""Megatron-Core attention modules and norms of Kimi K2.x / K3 / K3.1.

Each class is a Megatron module that slots into a megatron-core spec; the maths comes from
:mod:`kimi_core.reference` (the oracle) and its memory-linear attention from :mod:`kimi_core.attention`,
never rewritten here:

* :class:`KimiRMSNorm` - RMSNorm with fp32 statistics (``kimi_core.reference.ops.rms_norm``).
* :class:`KimiCoreAttention` - MLA core attention for the no-TransformerEngine case (memory linear in S,
  packed THD sequences, K3.1's sparse top-k): the local ``DotProductAttention`` rejects MLA's
  ``k_channels``/``v_channels`` (0.19.2:
  ``TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``).
* :class:`KimiMLA` - megatron-core ``MLASelfAttention`` (its TP projections, latent norms, RoPE/YaRN)
  plus K3's NoPE (a zero-angle rotary table, so the rotation is the identity), K3's sigmoid output
  gate ``g_proj`` and K3.1's frozen DSA indexer selection.
* :class:`KimiIndexer` - the K3.1 lightning indexer; scores come from ``kimi_core.reference.indexer``,
  the top-k from ``kimi_core.attention.blockwise_index_topk``.
* :class:`KimiKDA` - Kimi Delta Attention with TP over heads; CPU runs the reference
  ``chunk_kda``, CUDA runs fla's ``chunk_kda`` (same signature).

Context parallelism (``--context-parallel-size``): every module takes megatron's load-balanced shard of the
sequence; what each gathers over the CP group is in :mod:`kimi_megatron_plugin.models.context_parallel`.
Sequence parallelism (``--sequence-parallel``): :class:`KimiMLA` and :class:`KimiKDA` gather the sequence at their
entry and return their output's own rows (:mod:`kimi_megatron_plugin.models.sequence_parallel`).

The MLP slot (dense MLP, router, MoE layer) is :mod:`kimi_megatron_plugin.models.mlp`, the attention-residual
layer and output norm :mod:`kimi_megatron_plugin.models.attn_res`, the routed experts
:mod:`kimi_megatron_plugin.models.experts`.

Shapes follow megatron: activations ``[S, B, H]`` (sequence first).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from kimi_core.attention import blockwise_index_topk, causal_attention, segment_ids, sparse_topk_attention
from kimi_core.reference import kda as ref_kda
from kimi_core.reference.indexer import index_keys
from kimi_core.reference.ops import acc_dtype, l2norm, rms_norm
from kimi_megatron_plugin.models.context_parallel import (
    CPLayout,
    CPRotary,
    cp_group,
    cp_layout,
    gather_sequence,
    without_cp,
)
from kimi_megatron_plugin.models.parameters import compute_device, new_parameter, tp_size_rank
from kimi_megatron_plugin.models.sequence_parallel import (
    gather_tokens,
    mark_sequence_parallel,
    scatter_tokens,
    sequence_parallel_group,
    without_sequence_parallel,
)
from kimi_megatron_plugin.patches import apply_no_te_shims

apply_no_te_shims()

__all__ = [
    "GatherKVLatent",
    "KimiRMSNorm",
    "KimiCoreAttention",
    "KimiMLA",
    "KimiIndexer",
    "KimiKDA",
    "ReplicatedLinear",
]


class KimiRMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` with fp32 statistics; ``weight [hidden_size]``.

    Accepts megatron's norm-builder keywords (``config``, ``hidden_size``, ``eps``). With
    ``config.sequence_parallel`` the weight is marked ``sequence_parallel`` (it sees this rank's tokens only; megatron
    sums its gradient over TP), as megatron's own norms are. ``row_group`` (a TP group, set by :class:`KimiMLA` on its
    latent norms under sequence parallelism): the input is the whole sequence, the norm runs on this rank's rows and
    the result is gathered back, as megatron's sequence-parallel MLA norms its latents.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **_):
        super().__init__()
        dtype = config.params_dtype if config is not None else torch.float32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=compute_device(), dtype=dtype))
        self.eps = eps
        self.row_group = None
        if config is not None:
            mark_sequence_parallel([self.weight], config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_group is None:
            return rms_norm(x, self.weight, self.eps)
        return gather_tokens(rms_norm(scatter_tokens(x, self.row_group), self.weight, self.eps), self.row_group)


class ReplicatedLinear(torch.nn.Module):
    """Bias-free ``x @ weight.T`` replicated on every TP rank (small projections); ``weight [out, in]``.

    Returns a tensor (not megatron's ``(out, bias)`` pair).
    """

    def __init__(self, config, input_size: int, output_size: int):
        super().__init__()
        self.weight = new_parameter(config, output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# ---------------------------------------------------------------------------------------------- MLA
def packed_bounds(packed_seq_params) -> torch.Tensor | None:
    """``cu_seqlens [N + 1]`` of a THD batch from megatron's ``PackedSeqParams`` (the padded boundaries when
    given, as ``MLASelfAttention`` uses for RoPE), or None for an unpacked ``[S, B]`` batch."""
    if packed_seq_params is None:
        return None
    if packed_seq_params.qkv_format not in (None, "thd"):
        raise ValueError(
            f"kimi_megatron_plugin: packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is packed"
        )
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    kv = packed_seq_params.cu_seqlens_kv_padded
    kv = packed_seq_params.cu_seqlens_kv if kv is None else kv
    if kv is not None and not torch.equal(cu, kv):
        raise ValueError("kimi_megatron_plugin: self-attention needs packed_seq_params.cu_seqlens_q == cu_seqlens_kv")
    return cu


class KimiCoreAttention(MegatronModule):
    """Causal softmax attention for MLA, ``[S, B, n, d]`` (or packed ``[T, n, d]``) in, ``[S, B, n * dv]`` out.

    The maths of ``kimi_core.reference.mla`` with memory linear in S (:mod:`kimi_core.attention`):
    torch's fused SDPA on CUDA, the blockwise online softmax elsewhere; packed sequences
    (``packed_seq_params.cu_seqlens_q``, THD) attend within their own sequence. With
    ``topk_idx [B, S, K]`` (K3.1's DSA selection from :class:`KimiIndexer`) each query attends only
    its selected keys (sparse attention). megatron's causal ``attention_mask`` adds nothing and is dropped;
    any other explicit mask (True = masked out, ``[B, 1, S, S]``) takes the dense path, since the mask
    itself is already ``S x S``.

    Context parallelism: ``query`` holds this rank's load-balanced tokens and ``key``/``value`` the whole sequence
    in global order (:class:`KimiMLA` gathers the compressed latent and up-projects it); each local query attends
    them at its global position (``topk_idx`` then holds global key positions). Explicit masks are refused under CP.

    :param softmax_scale: from ``MultiLatentAttention`` (``qk_head_dim^-1/2 * mscale^2``).
    """

    def __init__(
        self,
        config,
        layer_number=1,
        attn_mask_type=None,
        attention_type="self",
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        **_,
    ):
        super().__init__(config=config)
        self.cp_group = cp_group(pg_collection) if config.context_parallel_size > 1 else None
        # the base ``Attention`` builds this once without MLA's arguments, MLA then rebuilds it
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        packed_seq_params=None,
        topk_idx: torch.Tensor | None = None,
        cp: CPLayout | None = None,
        **_,
    ):
        cu = packed_bounds(packed_seq_params)
        # THD: [T, n, d] -> [T, 1, n, d]
        query, key, value = (t.unsqueeze(1) if t.dim() == 3 else t for t in (query, key, value))
        S, B, n, d = query.shape
        scale = self.softmax_scale if self.softmax_scale is not None else d**-0.5
        if cp is None and self.cp_group is not None:
            cp = cp_layout(S, cu, query.device, self.cp_group)
        if attention_mask is not None and _is_causal_mask(attention_mask, S if cp is None else cp.total):
            attention_mask = None  # megatron's own causal mask: nothing beyond what the kernels do
        if cp is not None:
            if attention_mask is not None:
                raise ValueError(
                    "kimi_megatron_plugin: KimiCoreAttention with --context-parallel-size > 1 takes no explicit "
                    "attention_mask beyond the causal one (pass None)"
                )
            if key.shape[0] != cp.total:
                raise ValueError(
                    f"kimi_megatron_plugin: KimiCoreAttention with --context-parallel-size {cp.size} takes the whole "
                    f"sequence's keys and values ({cp.total} tokens, as KimiMLA gathers them), got {key.shape[0]}"
                )
            return _cp_attention(query, key, value, scale, cp, topk_idx)
        if attention_mask is not None:
            if cu is not None:
                raise ValueError("kimi_megatron_plugin: packed sequences take no attention_mask (pass None)")
            return _dense_masked_attention(query, key, value, scale, attention_mask, topk_idx)
        if topk_idx is not None:
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [B, S, n, d]
            o = sparse_topk_attention(q, k, v, topk_idx, scale)  # [B, S, n, dv]
            return o.transpose(0, 1).reshape(S, B, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, n, S, d]
        o = causal_attention(q, k, v, scale, cu)  # [B, n, S, dv]
        return o.permute(2, 0, 1, 3).reshape(S, B, -1)


def _cp_attention(query, k, v, scale, cp: CPLayout, topk_idx):
    """This CP rank's queries ``[S_local, B, n, d]`` against the whole sequence's ``k``/``v [S_global, B, n, d]``
    (global order) -> ``[S_local, B, n * dv]``."""
    S, B = query.shape[:2]
    if topk_idx is not None:
        q, k, v = (t.transpose(0, 1) for t in (query, k, v))  # [B, S, n, d]
        o = sparse_topk_attention(q, k, v, topk_idx, scale, q_pos=cp.positions)  # [B, S_local, n, dv]
        return o.transpose(0, 1).reshape(S, B, -1)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))  # [B, n, S, d]
    o = causal_attention(q, k, v, scale, cp.cu_seqlens, q_pos=cp.positions)  # [B, n, S_local, dv]
    return o.permute(2, 0, 1, 3).reshape(S, B, -1)


def _is_causal_mask(mask: torch.Tensor, S: int) -> bool:
    """Whether ``mask [B or 1, 1, S, S]`` (True = masked out) is exactly the causal mask, checked 1024 rows
    at a time (each row must be ``False * (i + 1), True * (S - 1 - i)``) without building another ``S x S``."""
    if mask.dim() != 4 or mask.shape[-2:] != (S, S) or mask.shape[1] != 1:
        return False
    for r0 in range(0, S, 1024):
        rows = mask[:, :, r0 : r0 + 1024].to(torch.int8)
        i = torch.arange(r0, r0 + rows.shape[-2], device=mask.device)
        if not torch.equal(rows.sum(-1, dtype=torch.int64), (S - 1 - i).expand_as(rows[..., 0])):
            return False
        if S > 1 and (rows[..., 1:] < rows[..., :-1]).any():  # a True before a False
            return False
    return True


def _dense_masked_attention(query, key, value, scale, attention_mask, topk_idx):
    """The reference's dense order of operations under an explicit ``[B, 1, S, S]`` mask (True = masked out):
    fp32 logits, mask (causal, the given mask, the DSA selection), softmax, cast back, ``probs @ v``."""
    S, B = query.shape[:2]
    Sk = key.shape[0]
    dt = query.dtype
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, n, S, d]
    logits = (q @ k.transpose(-1, -2)).to(acc_dtype(dt)) * scale  # [B, n, S, Sk]
    keep = torch.arange(Sk, device=q.device)[None, :] <= torch.arange(Sk - S, Sk, device=q.device)[:, None]
    keep = keep & ~attention_mask.to(torch.bool)
    if topk_idx is not None:
        sel = torch.zeros(B, S, Sk + 1, dtype=torch.bool, device=q.device)
        sel.scatter_(-1, topk_idx.where(topk_idx >= 0, Sk), True)
        keep = keep & sel[:, None, :, :Sk]
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1).to(dt)
    return (probs @ v).permute(2, 0, 1, 3).reshape(S, B, -1)


class _NoRotation(torch.nn.Module):
    """Zero-angle rotary table for K3's NoPE MLA (``mla_use_nope``): cos = 1, sin = 0, so the RoPE
    that ``MLASelfAttention`` applies is the identity (up to MLA's even/odd reordering, which it
    applies to q and k alike and so leaves q.k unchanged)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def get_rotary_seq_len(
        self,
        inference_context,
        transformer,
        transformer_input,
        transformer_config,
        packed_seq_params=None,
        *args,
        **kwargs,
    ) -> int:
        """The table length megatron's own embedding would ask for: the longest packed sequence, else the
        whole (sequence- and context-parallel) sequence, so its CP slicing finds every row it expects."""
        if packed_seq_params is not None:
            cu = packed_bounds(packed_seq_params)
            longest = int((cu[1:] - cu[:-1]).max()) if cu is not None and cu.numel() > 1 else 0
            given = [m for m in (packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv) if m is not None]
            return max([longest, *given])
        n = transformer_input.size(0)
        if transformer_config.sequence_parallel:
            n *= transformer_config.tensor_model_parallel_size
        return n * transformer_config.context_parallel_size

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **_):
        return torch.zeros(max_seq_len, 1, 1, self.dim, device=compute_device())


class KimiIndexer(MegatronModule):
    """K3.1 DSA lightning indexer (frozen, replicated on every TP rank).

    Parameters (HF names under ``self_attn.indexer``): ``wq_b [n_h*d, q_lora_rank]``, ``wk [d, H]``,
    ``k_norm.weight/bias [d]``, ``weights_proj [n_h, H]``; ``requires_grad=False``.
    ``forward(x [S, B, H], qr [S, B, q_lora_rank], cu_seqlens=None, cp=None) -> [B, S, K]`` int64 key indices
    (``-1`` = empty slot), the top-``index_topk`` visible keys of each query chosen blockwise
    (:func:`kimi_core.attention.blockwise_index_topk`, scores of ``kimi_core.reference.indexer``);
    None when ``index_topk >= S`` (every visible key is kept: plain causal attention). Under context parallelism
    (``cp``) the index keys are all-gathered, ``S`` is the global length and the indices are global positions.
    """

    def __init__(self, config, kimi):
        super().__init__(config=config)
        d, nh = kimi.index_head_dim, kimi.index_n_heads
        self.n_heads, self.head_dim, self.topk = nh, d, kimi.index_topk
        self.wq_b = ReplicatedLinear(config, kimi.q_lora_rank, nh * d)
        self.wk = ReplicatedLinear(config, config.hidden_size, d)
        self.k_norm = torch.nn.Module()
        self.k_norm.weight = new_parameter(config, d, init=False)
        self.k_norm.bias = new_parameter(config, d, init=False)
        with torch.no_grad():
            self.k_norm.weight.fill_(1.0)
            self.k_norm.bias.zero_()
        self.weights_proj = ReplicatedLinear(config, config.hidden_size, nh)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cp: CPLayout | None = None
    ):
        S, B = x.shape[:2]
        if self.topk >= (S if cp is None else cp.total):
            return None
        xb, qb = x.transpose(0, 1), qr.transpose(0, 1)  # [B, S, *]
        a = acc_dtype(x.dtype)
        q = self.wq_b(qb).to(a).view(B, S, self.n_heads, self.head_dim)
        k = index_keys(self.wk(xb), self.k_norm.weight, self.k_norm.bias)  # [B, S, d]
        if cp is not None:
            k = gather_sequence(k, cp, dim=1, differentiable=False)  # [B, S_global, d]
            return blockwise_index_topk(q, k, self.weights_proj(xb), self.topk, cp.seg, q_pos=cp.positions)
        seg = None if cu_seqlens is None else segment_ids(cu_seqlens, S)
        return blockwise_index_topk(q, k, self.weights_proj(xb), self.topk, seg)


class GatherKVLatent(torch.autograd.Function):
    """All-gather of ``linear_kv_down_proj``'s column shards whose backward sums the rope-key gradient.

    Forward: ``[S, B, (kv_lora_rank + rope)/tp]`` per rank -> ``[S, B, kv_lora_rank + rope]`` on every
    rank (the same values as megatron's gather). Backward, on the full-width gradient ``g``: the
    ``kv_compressed`` columns ``g[..., :kv_lora_rank]`` are already complete and identical on every
    rank (they pass ``linear_kv_up_proj``'s input all-reduce), but the shared rope key
    ``k_pe = g[..., kv_lora_rank:]`` is consumed by this rank's heads only, so its columns are
    all-reduced over TP before the rank keeps its own slice. (Megatron's plain gather keeps only the
    owning rank's partial ``k_pe`` gradient: the TP > 1 input/weight gradient gap.)
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, kv_lora_rank: int, group) -> torch.Tensor:
        ctx.kv_lora_rank, ctx.group = kv_lora_rank, group
        tp, rank = group.size(), torch.distributed.get_rank(group)
        ctx.width, ctx.rank = local.shape[-1], rank
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous().clone()  # own buffer: the all-reduce below must land in what we return
        rope = g[..., ctx.kv_lora_rank :].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        g[..., ctx.kv_lora_rank :] = rope
        w = ctx.width
        return g[..., ctx.rank * w : (ctx.rank + 1) * w].contiguous(), None, None


def _kv_down_full_output(self, input_, *args, **kwargs):
    """``forward`` bound onto ``KimiMLA.linear_kv_down_proj`` (a ``ColumnParallelLinear``) when TP > 1:
    returns the full-width ``kv_combined`` through :class:`GatherKVLatent`, so
    ``MLASelfAttention.get_query_key_value_tensors`` takes its unsharded branch (split only)."""
    out, bias = ColumnParallelLinear.forward(self, input_, *args, **kwargs)
    return GatherKVLatent.apply(out, self.config.kv_lora_rank, self.tp_group), bias


class KimiMLA(MLASelfAttention):
    """``MLASelfAttention`` with K3's NoPE and output gate and K3.1's indexer.

    Reuses megatron's TP projections (``linear_q_down_proj``, ``linear_q_up_proj``,
    ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``), latent norms and RoPE/YaRN.
    Adds ``linear_g_proj`` (column-parallel, ``g_proj [n*dv, H]``) when ``mla_use_output_gate``
    and ``indexer`` when the config has ``index_topk``. ``forward`` is the training/prefill path
    only (no inference context): ``[S, B, H] -> ([S, B, H], None)``; packed sequences (THD,
    ``packed_seq_params``) come as ``[T, 1, H]``, RoPE restarting per sequence (megatron's own).
    With context parallelism the rotary table is taken at this rank's global positions (:class:`CPRotary`) and the
    indexer and core attention see every rank's keys.

    Sequence parallelism: ``hidden_states`` is this TP rank's ``[S/tp, B, H]``; the layer gathers the sequence once,
    runs megatron's MLA with its linears built without sequence parallelism (whole sequence, this rank's heads) and
    returns ``linear_proj``'s output rows of this rank. The latent norms ``q_layernorm`` / ``kv_layernorm`` run on
    this rank's rows (megatron's sequence-parallel MLA does the same; their gradients are partial, marked
    ``sequence_parallel``).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=None,
        cp_comm_type=None,
        pg_collection=None,
        kimi=None,
        **kw,
    ):
        from megatron.core.transformer.enums import AttnMaskType

        sp = sequence_parallel_group(config)
        outer, config = config, without_sequence_parallel(config)
        self_cp = cp_group(pg_collection) if config.context_parallel_size > 1 else None
        if self_cp is not None:
            # megatron's YaRN table slices itself for CP at construction, with a pinned CUDA index a CPU process
            # cannot build: construct against a one-rank CP group, then hand the real one back (CPRotary slices)
            pg_collection = without_cp(pg_collection)
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type=attn_mask_type or AttnMaskType.causal,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            **kw,
        )
        self.kimi = kimi
        if kimi.mla_use_nope:
            self.rotary_pos_emb = _NoRotation(config.qk_pos_emb_head_dim)
        self.sp_group = sp
        if sp is not None:
            for norm in (self.q_layernorm, self.kv_layernorm):
                norm.row_group = sp
                mark_sequence_parallel([norm.weight], outer)
        self.cp_group = self_cp
        if self_cp is not None:
            self.pg_collection.cp = self_cp  # megatron's THD RoPE picks each sequence's rows by this group
            self.core_attention.cp_group = self_cp
            self.rotary_pos_emb = CPRotary(self.rotary_pos_emb, self_cp)
        self.linear_g_proj = None
        if kimi.mla_use_output_gate:
            self.linear_g_proj = ColumnParallelLinear(
                config.hidden_size,
                config.num_attention_heads * config.v_head_dim,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                skip_bias_add=True,
            )
        self.indexer = KimiIndexer(config, kimi) if kimi.has_indexer else None
        # TP > 1: megatron gathers ``linear_kv_down_proj``'s output and splits the gradient back, so
        # the shared rope key ``k_pe`` (used by every rank's heads, held in one rank's columns) would
        # get only the owning rank's heads' gradient. The layer (weights still column-split, same
        # checkpoint slices) instead returns the gathered output through ``GatherKVLatent``.
        if tp_size_rank()[0] > 1:
            if not isinstance(self.linear_kv_down_proj, ColumnParallelLinear):
                raise TypeError(
                    f"kimi_megatron_plugin: KimiMLA needs linear_kv_down_proj=ColumnParallelLinear, "
                    f"got {type(self.linear_kv_down_proj).__name__}"
                )
            self.linear_kv_down_proj.forward = _kv_down_full_output.__get__(self.linear_kv_down_proj)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
        position_ids=None,
        **_,
    ):
        if inference_context is not None:
            raise NotImplementedError(
                "kimi_megatron_plugin: KimiMLA supports the training/prefill path only (no inference_context)"
            )
        hidden_states = gather_tokens(hidden_states, self.sp_group)  # sequence parallel: [S/tp] -> [S]
        q, k, v, qr, kv_latent = self.get_query_key_value_tensors(hidden_states, None, position_ids, packed_seq_params)
        if qr.dim() == 2:  # THD: megatron squeezes the batch dim of packed latents
            qr = qr.unsqueeze(1)
        cu = packed_bounds(packed_seq_params)
        cp = cp_layout(hidden_states.shape[0], cu, hidden_states.device, self.cp_group) if self.cp_group else None
        if cp is not None:
            k, v = self._whole_sequence_kv(k, kv_latent, cp)
        topk_idx = self.indexer(hidden_states, qr, cu, cp) if self.indexer is not None else None
        core = self.core_attention(
            q, k, v, attention_mask, packed_seq_params=packed_seq_params, topk_idx=topk_idx, cp=cp
        )  # [S, B, n_local * dv]
        if self.linear_g_proj is not None:
            core = core * torch.sigmoid(self.linear_g_proj(hidden_states)[0])
        out, bias = self.linear_proj(core)
        return scatter_tokens(out, self.sp_group), bias

    def _whole_sequence_kv(self, key, kv_latent, cp: CPLayout):
        """Keys and values of the whole sequence from every CP rank's compressed latent.

        Gathers ``[kv_compressed (normed) | k_pe (rotated)]`` (``kv_lora_rank + rope`` values a token, against
        ``n/tp * (dqk + dv)`` for the up-projected K/V) and runs ``linear_kv_up_proj`` on every token. ``key`` is
        megatron's ``[S, B, n, dqk]`` (THD ``[T, n, dqk]``), read for its rotated rope part (the same in every head);
        ``kv_latent`` ``[S, B, kv_lora_rank]`` (THD ``[T, kv_lora_rank]``). Returns ``[S_global, B, n, dqk]``,
        ``[S_global, B, n, dv]`` in global order."""
        c = self.config
        if kv_latent.dim() == 2:  # THD
            kv_latent, key = kv_latent.unsqueeze(1), key.unsqueeze(1)
        k_pe = key[:, :, 0, c.qk_head_dim :].to(kv_latent.dtype)  # [S, B, rope]
        full = gather_sequence(torch.cat([kv_latent, k_pe], dim=-1), cp)  # [S_global, B, kv_lora_rank + rope]
        kv_c, k_pe = full.split([c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        kv = self.linear_kv_up_proj(kv_c)[0]
        n = self.num_attention_heads_per_partition
        kv = kv.view(*kv.shape[:2], n, c.qk_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_head_dim, c.v_head_dim], dim=-1)
        k_pe = k_pe.to(k_nope.dtype).unsqueeze(2).expand(-1, -1, n, -1)
        return torch.cat([k_nope, k_pe], dim=-1).contiguous(), v.contiguous()


# ---------------------------------------------------------------------------------------------- KDA
def _spans(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """Non-empty ``(start, end)`` token ranges of packed sequences; padding after the last one is its own span."""
    b = cu_seqlens.tolist()
    if b[-1] < total:
        b.append(total)
    return [(s, e) for s, e in zip(b, b[1:]) if e > s]


class KimiKDA(MegatronModule):
    """Kimi Delta Attention with tensor parallelism over heads.

    Parameters keep the HF names (``self_attn.<name>`` <-> ``self_attention.<name>``):
    ``q_proj/k_proj/v_proj/g_proj`` and ``f_b_proj`` column-parallel ``[P/tp, *]``, ``b_proj``
    column-parallel ``[heads/tp, H]``, ``{q,k,v}_conv1d.weight [P/tp, 1, W]`` (fp32),
    ``A_log [heads/tp]`` (fp32, stored unpadded: see the mapping hooks), ``dt_bias [P/tp]`` (fp32),
    ``f_a_proj [head_dim, H]`` and ``o_norm.weight [head_dim]`` replicated, ``o_proj`` row-parallel.
    ``P = heads * head_dim``. Maths: ``kimi_core.reference.kda`` (module docstring there).

    Sequence parallelism: the layer gathers its ``[S/tp, B, H]`` input once, runs its linears (built without
    sequence parallelism), convs and recurrence on the whole sequence and returns ``o_proj``'s rows of this rank.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=1,
        attn_mask_type=None,
        cp_comm_type=None,
        pg_collection=None,
        kimi=None,
        **_,
    ):
        super().__init__(config=config)
        self.sp_group = sequence_parallel_group(config)
        config = without_sequence_parallel(config)  # the linears below see the gathered sequence
        la = kimi.linear_attn
        tp, _r = tp_size_rank()
        if la.num_heads % tp:
            raise ValueError(
                f"config.json: linear_attn_config.num_heads={la.num_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )
        self.cp_group = cp_group(pg_collection) if config.context_parallel_size > 1 else None
        self.kimi, self.layer_number = kimi, layer_number
        self.H, self.D = la.num_heads // tp, la.head_dim
        self.lower_bound, self.eps = la.gate_lower_bound, kimi.rms_norm_eps
        H, P, D, W = config.hidden_size, la.num_heads * la.head_dim, la.head_dim, la.short_conv_kernel_size

        def col(out):
            return ColumnParallelLinear(
                H if out != "f_b" else D,
                P if out != "b" else la.num_heads,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                skip_bias_add=True,
            )

        self.q_proj, self.k_proj, self.v_proj = col("q"), col("k"), col("v")
        for n in ("q", "k", "v"):
            m = torch.nn.Module()
            m.weight = new_parameter(config, P // tp, 1, W, partition_dim=0, dtype=torch.float32)
            setattr(self, f"{n}_conv1d", m)
        self.f_a_proj = ReplicatedLinear(config, H, D)
        self.f_b_proj = col("f_b")
        self.b_proj = col("b")
        self.full_rank_gate = la.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = col("g")
        else:
            self.g_a_proj = ReplicatedLinear(config, H, D)
            self.g_b_proj = col("f_b")
        self.A_log = new_parameter(config, self.H, init=False, partition_dim=0, dtype=torch.float32)
        self.dt_bias = new_parameter(config, P // tp, init=False, partition_dim=0, dtype=torch.float32)
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, self.H)))
            self.dt_bias.zero_()
        self.o_norm = KimiRMSNorm(config, D, kimi.rms_norm_eps)
        self.o_proj = RowParallelLinear(
            P,
            H,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    @staticmethod
    def _kernel(q):
        """fla's Triton ``chunk_kda`` on CUDA, kimi_core's torch reference elsewhere (same (o, state)
        contract). ``KIMI_KDA_KERNEL=reference`` forces the reference on CUDA too (parity runs, or a
        machine without a warm Triton cache: fla's backward autotuning takes many minutes cold)."""
        mode = os.environ.get("KIMI_KDA_KERNEL", "auto")
        if mode not in ("auto", "fla", "reference"):
            raise ValueError(f"KIMI_KDA_KERNEL={mode!r}: expected auto, fla or reference")
        if q.is_cuda and mode != "reference":
            from fla.ops.kda import chunk_kda

            return chunk_kda
        return ref_kda.chunk_kda

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None, **_):
        """``[S, B, H]`` (or packed ``[T, 1, H]`` with ``packed_seq_params``) -> ``([S, B, H], bias)``.

        Packed sequences: the projections run on all tokens; the two sequence mixers (the short causal
        conv and the delta-rule recurrence) restart at every ``cu_seqlens`` boundary (zero conv state, zero
        recurrent state), so each sequence equals itself run alone: the conv and the torch ``chunk_kda``
        one sequence at a time, fla's ``chunk_kda`` in one varlen call (its ``cu_seqlens``).

        Context parallelism: the projections run on this rank's tokens; their mixer inputs (pre-conv q/k/v, the
        gate's ``f``, the raw ``beta``) are all-gathered in one call, the conv and the recurrence run over the
        whole sequence and this rank keeps its own rows (the gather's backward reduce-scatters the gradient).
        """
        if inference_context is not None:
            raise NotImplementedError("kimi_megatron_plugin: KimiKDA supports the training/prefill path only")
        hidden_states = gather_tokens(hidden_states, self.sp_group)  # sequence parallel: [S/tp] -> [S]
        x = hidden_states.transpose(0, 1)  # [B, T, H]
        B, T, _ = x.shape
        H, D = self.H, self.D
        a = acc_dtype(x.dtype)
        cu = packed_bounds(packed_seq_params)
        mixer_in = [getattr(self, f"{n}_proj")(x)[0] for n in ("q", "k", "v")]  # pre-conv q, k, v [B, T, H*D]
        mixer_in += [self.f_b_proj(self.f_a_proj(x))[0], self.b_proj(x)[0]]  # gate input [B, T, H*D], beta [B, T, H]
        cp = cp_layout(T, cu, x.device, self.cp_group) if self.cp_group is not None else None
        if cp is None:
            o = self._mix(*mixer_in, cu)
        else:
            widths = [t.shape[-1] for t in mixer_in]
            full = gather_sequence(torch.cat(mixer_in, dim=-1), cp, dim=1)  # [B, T_global, 4*H*D + H]
            o = self._mix(*full.split(widths, dim=-1), cu).index_select(1, cp.positions)
        gate = self.g_proj(x)[0] if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))[0]
        # o_norm is replicated but sees only this rank's heads: sum its gradient over TP
        w_norm = (
            copy_to_tensor_model_parallel_region(self.o_norm.weight) if tp_size_rank()[0] > 1 else self.o_norm.weight
        )
        o = rms_norm(o, w_norm.to(a), self.eps) * torch.sigmoid(gate.to(a).view(B, T, H, D))
        out, bias = self.o_proj(o.reshape(B, T, H * D).to(x.dtype))
        return scatter_tokens(out.transpose(0, 1), self.sp_group), bias

    def _mix(self, yq, yk, yv, f, b, cu):
        """The sequence mixers over whole sequences: short conv + l2norm of q/k, the gate, beta and ``chunk_kda``.

        ``yq``/``yk``/``yv``/``f [B, T, H*D]``, ``b [B, T, H]`` (this rank's heads, every token of the sequences);
        ``cu``: packed bounds or None. Returns ``o [B, T, H, D]`` in the accumulation dtype."""
        B, T = yq.shape[:2]
        H, D = self.H, self.D
        a = acc_dtype(yq.dtype)
        spans = [(0, T)] if cu is None else _spans(cu, T)

        def per_seq(fn, *ts):
            return torch.cat([fn(*(t[:, s:e] for t in ts)) for s, e in spans], dim=1)

        qkv = []
        for n, y in zip(("q", "k", "v"), (yq, yk, yv)):
            w = getattr(self, f"{n}_conv1d").weight.to(a)
            y = per_seq(lambda t, w=w: ref_kda.causal_conv(t, w, None)[0], y)
            qkv.append(y.view(B, T, H, D))
        q, k, v = qkv
        q, k = l2norm(q), l2norm(k)
        g = ref_kda.kda_gate(f.view(B, T, H, D), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(b.to(a))
        kernel = self._kernel(q)
        if cu is not None and kernel is not ref_kda.chunk_kda:
            # fla's varlen entry: one launch over all sequences, the state reset at each boundary (batch 1)
            bounds = torch.tensor([0, *(e for _s, e in spans)], dtype=torch.long, device=q.device)
            return kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=bounds)[0]
        return per_seq(lambda *t: kernel(*t, initial_state=None, output_final_state=False)[0], q, k, v, g, beta)
