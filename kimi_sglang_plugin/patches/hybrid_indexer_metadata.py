"""K3.1 on SGLang 0.5.17: the DSA indexer of the MLA layers gets its metadata through K3's hybrid backend.

K3/K3.1 run their KDA and MLA layers under ``HybridLinearAttnBackend``, which hands each call to the full
(MLA) or the linear (KDA) backend. On 0.5.17 it does not override ``get_indexer_metadata``, so the indexer
asks the wrapper, gets the base class's ``None`` ("this backend has no indexer"), returns no top-k indices, and
the DSA backend's ``flashmla_sparse`` prefill raises ``'NoneType' object has no attribute 'unsqueeze'``
(``layers/attention/dsa_backend.py:2423``, the K3.1 class with ``--attention-backend dsa``).
0.5.23 forwards it to the full-attention backend for full-attention layers
(``layers/attention/hybrid_linear_attn_backend.py:1315``); this hook does the same on 0.5.17.
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.hook_patch import HOST, ONLY_0517, HookPatch

#: this patch's ledger row
ENTRY = HookPatch(
    name="hybrid_indexer_metadata",
    target="sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.get_indexer_metadata",
    host=HOST,
    hook="around",
    fn=f"{__name__}:indexer_metadata_from_full_backend",
    why="K3's hybrid KDA + MLA backend inherits get_indexer_metadata -> None on 0.5.17, so K3.1's DSA indexer "
    "returns no top-k and flashmla_sparse prefill raises on None",
    how="AROUND: for a full-attention layer with no metadata, return full_attn_backend.get_indexer_metadata",
    upstream="fixed in 0.5.23 (layers/attention/hybrid_linear_attn_backend.py:1315)",
    remove_when="0.5.17 leaves the supported releases",
    versions=ONLY_0517,
    absent_in="0.5.23: HybridLinearAttnBackend forwards get_indexer_metadata to its full-attention backend",
)


def indexer_metadata_from_full_backend(original, backend, layer_id, forward_batch):
    """AROUND ``HybridLinearAttnBackend.get_indexer_metadata``: the full-attention backend's metadata
    for a full-attention layer (``layer_id`` in ``backend.full_attn_layers``), else what the original gives."""
    got = original(backend, layer_id, forward_batch)
    if got is None and layer_id in backend.full_attn_layers:
        return backend.full_attn_backend.get_indexer_metadata(layer_id, forward_batch)
    return got
