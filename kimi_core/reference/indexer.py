"""DSA lightning indexer for Kimi K3.1 (frozen): which earlier tokens each MLA query may attend to.

Everything K3.1-specific here is **[I] inferred**: no public K3.1 config or code exists
(``docs/models.md``, K3.1). The design follows DeepSeek-V3.2-Exp's ``Indexer``
minus RoPE (K3's MLA is NoPE), minus the Hadamard rotation (orthogonal on q and k, so q·k is
unchanged) and minus the fp8 quantisation (an fp32 reference skips it). Weights, per MLA layer,
under ``self_attn.indexer.``: ``wq_b [n_h*d, q_lora_rank]``, ``wk [d, hidden]``,
``k_norm`` (LayerNorm weight and bias ``[d]``), ``weights_proj [n_h, hidden]``.

For query t and key s <= t::

    q_{t,h} = wq_b(qr_t)_h          qr = q_a_layernorm(q_a_proj x), MLA's normalised query latent
    k_s     = LayerNorm(wk x_s)     one key head shared by all index heads
    w_{t,h} = weights_proj(x_t)_h * n_h^-1/2 * d^-1/2                   (fp32)
    I_{t,s} = sum_h w_{t,h} ReLU(q_{t,h} . k_s);   keep = top-k_s I_{t,s}, k = min(index_topk, t+1)

The selected keys are a mask (0 / -inf) added to the MLA logits; scores are not used as weights
and the indexer gets no gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.reference.ops import acc_dtype, layer_norm

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig
    from kimi_core.lora.resolve import AdapterLookup
    from kimi_core.reference.weights import Weights

__all__ = ["INDEXER_K_NORM_EPS", "Indexer", "index_keys", "index_scores", "topk_mask"]

# LayerNorm eps of the indexer keys: 1e-6 as in DeepSeek-V3.2's reference LayerNorm [I].
INDEXER_K_NORM_EPS = 1e-6


def index_keys(wk_x: torch.Tensor, k_norm_weight: torch.Tensor, k_norm_bias: torch.Tensor) -> torch.Tensor:
    """Index keys ``k = LayerNorm(wk x)``: ``wk_x [..., d]`` -> ``[..., d]`` in ``acc_dtype`` (fp32)."""
    a = acc_dtype(wk_x.dtype)
    return layer_norm(wk_x, k_norm_weight.to(a), k_norm_bias.to(a), INDEXER_K_NORM_EPS).to(a)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``I [B, T, S] = sum_h w_{t,h} n_h^-1/2 d^-1/2 ReLU(q_{t,h} . k_s)`` in ``acc_dtype`` (fp32).

    :param q: ``[B, T, n_h, d]`` index queries ``wq_b(qr)``; ``k``: ``[B, S, d]`` from :func:`index_keys`;
        ``weights``: ``[B, T, n_h]`` the raw ``weights_proj(x)`` (the head scale is applied here).
    """
    a = acc_dtype(q.dtype)
    nh, d = q.shape[-2], q.shape[-1]
    wts = weights.to(a) * (nh**-0.5) * (d**-0.5)
    rel = torch.relu(torch.einsum("bthd,bsd->bths", q.to(a), k.to(a)))
    return torch.einsum("bth,bths->bts", wts, rel)


def topk_mask(scores: torch.Tensor, causal: torch.Tensor, topk: int) -> torch.Tensor:
    """Boolean ``[B, T, S]``: the ``min(topk, #visible)`` highest-scoring visible keys of each query.

    :param scores: ``[B, T, S]`` index scores; ``causal``: ``[T, S]`` bool (True = visible).
    With ``topk >= S`` every visible key is kept, so the mask equals ``causal`` exactly.
    """
    S = scores.shape[-1]
    if topk >= S:
        return causal.expand_as(scores).clone()
    masked = scores.masked_fill(~causal, float("-inf"))
    idx = masked.topk(topk, dim=-1).indices
    keep = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, idx, True)
    return keep & causal  # rows with fewer than topk visible keys picked some -inf ones: drop them


class Indexer:
    """The indexer of one MLA layer; ``prefix`` ends with ``self_attn``. Cache key: ``idx_k [B, S, d]``."""

    def __init__(self, config: KimiConfig, weights: Weights, prefix: str):
        self.cfg, self.w, self.p = config, weights, f"{prefix}.indexer"
        self.nh, self.d, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk

    @torch.no_grad()
    def scores(
        self, x: torch.Tensor, qr: torch.Tensor, cache: dict, adapter: AdapterLookup | None = None
    ) -> torch.Tensor:
        """Index scores ``I [B, T, S]`` (fp32) of the T new queries against all S cached+new keys.

        :param x: ``[B, T, hidden]`` normed attention input; ``qr``: ``[B, T, q_lora_rank]``.
        Appends the new keys to ``cache["idx_k"]``.
        """
        w, p = self.w, self.p
        B, T, _ = x.shape
        a = acc_dtype(x.dtype)
        q = w.linear(qr, f"{p}.wq_b", adapter).to(a).view(B, T, self.nh, self.d)
        k = index_keys(
            w.linear(x, f"{p}.wk", adapter), w.tensor(f"{p}.k_norm.weight", a), w.tensor(f"{p}.k_norm.bias", a)
        )
        if "idx_k" in cache:
            k = torch.cat([cache["idx_k"], k], dim=1)
        cache["idx_k"] = k
        return index_scores(q, k, w.linear(x, f"{p}.weights_proj", adapter))

    def mask(
        self, x: torch.Tensor, qr: torch.Tensor, cache: dict, causal: torch.Tensor, adapter: AdapterLookup | None = None
    ) -> torch.Tensor:
        """Boolean keep-mask ``[B, T, S]`` (see :func:`topk_mask`)."""
        return topk_mask(self.scores(x, qr, cache, adapter), causal, self.topk)
