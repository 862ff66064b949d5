"""Attention with memory linear in the sequence length: MLA's causal attention (fused SDPA on CUDA,
blockwise online softmax elsewhere), K3.1's sparse top-k attention and the indexer's blockwise top-k, each also for a context-parallel rank's queries
against the gathered keys (``q_pos``; the layout in :mod:`kimi_core.attention.cp_layout`).
The naive twins are in :mod:`kimi_core.reference` (``mla``, ``indexer``)."""

from kimi_core.attention.blockwise import blockwise_causal_attention, segment_ids
from kimi_core.attention.causal import causal_attention, uses_fused_attention
from kimi_core.attention.cp_layout import load_balanced_positions
from kimi_core.attention.indexer_topk import blockwise_index_topk
from kimi_core.attention.sparse_topk import sparse_topk_attention

__all__ = [
    "blockwise_causal_attention",
    "blockwise_index_topk",
    "causal_attention",
    "load_balanced_positions",
    "segment_ids",
    "sparse_topk_attention",
    "uses_fused_attention",
]
