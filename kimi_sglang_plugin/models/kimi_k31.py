"""Kimi K3.1 for SGLang 0.5.17 and 0.5.23: the in-tree K3 model with a DSA lightning indexer on every MLA layer.

How the indexer gets there. ``DeepseekV2AttentionMLA.__init__`` (K3's MLA base class) builds
``self.indexer`` (``layers/attention/dsa/dsa_indexer.Indexer``: ``wq_b``, ``wk``, ``k_norm``
LayerNorm with bias, ``weights_proj`` -- the HF names of ``self_attn.indexer.*``) whenever
``is_deepseek_dsa(config)`` holds, and the ``k31_dsa_gates.is_deepseek_dsa`` hook makes it hold for K3.1
configs. The same gate selects SGLang's DSA index-K pool and attention backends. So this class
adds only what differs from a DeepSeek-V3.2 indexer and what must not fail silently:

* K3's MLA is NoPE, and so is K3.1's indexer (``kimi_core.reference.indexer``, inferred [I]):
  the stock indexer rotates the first ``qk_rope_head_dim`` dims of q and k, so its rotary
  embedding is replaced by :class:`NoRope` (identity; keeps ``cos_sin_cache`` for code that
  reads it -- the fused CUDA/ROCm indexer paths that rotate inside a kernel are off for K3.1's
  neox-style config and are listed as GPU checks in ``docs/sglang.md``).
* K3's ``load_weights`` skips names it has no parameter for; :meth:`load_weights` raises,
  naming the tensor, if an indexer weight of the checkpoint did not load.

Entry point for ``SGLANG_EXTERNAL_MODEL_PACKAGE=kimi_sglang_plugin.models``: importing this
module registers the config and applies the hooks (idempotent), then ``EntryClass`` is read. When
the hooks cannot apply, the import registers the refusal classes (``kimi_sglang_plugin.host_support``)
and fails with the reason, which SGLang logs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kimi_core.architectures import K31
from kimi_core.errors import PluginError
from kimi_sglang_plugin.registration import refuse_kimi, register_config, register_hooks, running_sglang

try:
    register_config()
    register_hooks()
except PluginError as _e:
    refuse_kimi(str(_e))
    raise

from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration, KimiK3MLAAttention

from kimi_sglang_plugin.models.kimi_k31_config import INDEXER_FIELDS, is_k31_config

__all__ = [
    "KimiK31ForConditionalGeneration",
    "NoRope",
    "EntryClass",
    "check_dsa_attention_backend",
    "check_index_topk",
    "INDEX_TOPK_SERVED",
]

logger = logging.getLogger(__name__)

INDEXER_PARAMS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


class NoRope(nn.Module):
    """Identity rotary embedding: ``forward(positions, q, k) -> (q, k)`` unchanged.

    ``q``: ``[T, heads, rope_dim]``, ``k``: ``[T, rope_dim]`` (any dtype).
    """

    def __init__(self, like: nn.Module | None = None):
        super().__init__()
        cache = getattr(like, "cos_sin_cache", None)
        if isinstance(cache, torch.Tensor):
            self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key, *args, **kwargs):
        return query, key


#: the attention backends that read SGLang's DSA KV pool ("nsa": 0.5.17's deprecated alias of "dsa")
DSA_BACKENDS = ("dsa", "nsa")
#: what a K3.1 engine on Hopper with a bf16 KV cache is started with (SGLang picks these only for the DeepSeek
#: architectures it lists; docs/sglang.md, "engine flags")
K31_ENGINE_FLAGS = (
    "--attention-backend dsa --page-size 64 --dsa-prefill-backend flashmla_sparse "
    "--dsa-decode-backend flashmla_sparse, and SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD="
    "<index_topk> (0 where FA3 is not installed)"
)


def check_dsa_attention_backend() -> None:
    """Refuse, naming the flag, an engine whose attention backends cannot serve K3.1: its KV cache is SGLang's
    DSA pool (``DSATokenToKVPool``), which only the DSA backend reads; the triton backend, for one, fails at
    init with an ``AttributeError`` on ``get_v_head_dim``. Reads the values in effect, ``get_exec().kernel``
    (0.5.17 and 0.5.23)."""
    from sglang.srt.runtime_context import get_exec

    kernel = get_exec().kernel
    chosen = {
        f: getattr(kernel, f, None)
        for f in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    }
    wrong = {f: v for f, v in chosen.items() if v is not None and v not in DSA_BACKENDS}
    if wrong or chosen["attention_backend"] is None:
        flag, value = next(iter(wrong.items()), ("attention_backend", None))
        raise PluginError(
            f"{K31}: --{flag.replace('_', '-')} {value} cannot serve K3.1, whose KV cache is "
            f"SGLang's DSA pool (only the dsa attention backend reads it); start the engine with "
            f"{K31_ENGINE_FLAGS}"
        )


#: the ``index_topk`` values each release's DSA prefill serves with a bf16 KV cache (absent: any). SGLang 0.5.17's
#: ``transform_index_page_table_prefill_fast`` (``kernels/ops/attention/dsa/transform_index.py:168``, the only
#: prefill index transform there) asserts a top-k width of 2048, DeepSeek-V3.2's and the K3.1 release's value
#: (an engine at another width dies on that assert at its first prefill); 0.5.23 has a general path
#: (``:286``). ``tests/kimi_sglang_plugin/models/test_kimi_k31.py`` reads both sources.
INDEX_TOPK_SERVED = {"0.5.17": (2048,)}


def check_index_topk(index_topk: int, release: str | None = None) -> None:
    """Refuse, naming the release and the field, an ``index_topk`` the running SGLang's DSA prefill cannot serve."""
    release = release or running_sglang()
    served = INDEX_TOPK_SERVED.get(release)
    if served is not None and index_topk not in served:
        raise ValueError(
            f"config.json: text_config.index_topk {index_topk} cannot be served by SGLang {release}, "
            f"whose DSA prefill index transform serves only {list(served)} (the K3.1 release's value "
            f"is 2048); use SGLang 0.5.23 for another top-k"
        )


class KimiK31ForConditionalGeneration(KimiK3ForConditionalGeneration):
    """K3 + DSA indexer (see the module docstring). Constructor and forward are K3's."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs) -> None:
        if not is_k31_config(config) or not is_k31_config(config.text_config):
            missing = [f for f in INDEXER_FIELDS if getattr(config.text_config, f, None) is None]
            raise ValueError(
                f"config.json: {K31} needs text_config.{'/'.join(INDEXER_FIELDS)} "
                f"(missing {missing}) and model_type 'kimi_k31' (got {config.model_type!r})"
            )
        check_dsa_attention_backend()
        check_index_topk(config.text_config.index_topk)
        super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        if self.language_model is not None:
            self._indexed_layers = self._install_nope_indexers()

    def mla_layers(self):
        """``[(layer id, KimiK3MLAAttention)]`` of this rank's MLA layers."""
        out = []
        for i, layer in enumerate(self.language_model.model.layers):
            attn = getattr(layer, "self_attn", None)
            if isinstance(attn, KimiK3MLAAttention):
                out.append((getattr(attn, "layer_id", i), attn))
        return out

    def _install_nope_indexers(self) -> list[int]:
        """Every MLA layer runs its own NoPE indexer and returns its attention output alone.

        SGLang's DSA attention (``DeepseekMLAForwardMixin.forward_absorb_core``, 0.5.17 and 0.5.23) returns
        ``(output, topk_indices)`` whenever ``next_skip_topk`` is not ``None`` (DeepSeek's "index cache",
        where a layer reuses the previous layer's top-k), and ``use_dsa`` always sets it to a bool. DeepSeek's
        decoder layer unpacks that pair; K3's decoder layer adds the attention output to the residual stream
        as a tensor and passes no top-k between layers (the pair would raise ``TypeError: Tensor + tuple`` in
        ``attn_residual._aggregate_fused_add`` at the first K3.1 prefill). So
        ``next_skip_topk`` is set to ``None`` (the early ``return output``), and a config in which a layer
        would reuse another's top-k (``skip_topk``) is refused: K3's decoder could not hand it one."""
        ids = []
        for lid, attn in self.mla_layers():
            idx = getattr(attn, "indexer", None)
            if getattr(attn, "skip_topk", False):
                raise ValueError(
                    f"config.json: {K31} MLA layer {lid} would reuse the previous layer's DSA "
                    "top-k (SGLang's index cache: cli_factor / a skip-top-k pattern), which K3's "
                    "decoder layer cannot pass between layers; K3.1 runs an indexer on every MLA layer"
                )
            if idx is None:
                raise RuntimeError(
                    f"{K31}: MLA layer {lid} has no indexer; the is_deepseek_dsa hook "
                    "is not applied in this process (kimi_sglang_plugin.register())"
                )
            idx.rotary_emb = NoRope(getattr(idx, "rotary_emb", None))
            attn.next_skip_topk = None
            ids.append(lid)
        return ids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        seen: set[str] = set()

        def record(stream):
            for item in stream:
                if ".indexer." in item[0]:
                    seen.add(item[0])
                yield item

        out = super().load_weights(record(weights))
        prefix = "language_model.model.layers"
        want = {f"{prefix}.{lid}.self_attn.indexer.{p}" for lid in self._indexed_layers for p in INDEXER_PARAMS}
        missing = sorted(want - seen)
        if missing:
            raise ValueError(
                f"{K31}: checkpoint has no tensor {missing[0]!r} "
                f"({len(missing)} indexer tensors missing); is this a K3.1 checkpoint?"
            )
        return out


EntryClass = [KimiK31ForConditionalGeneration]
