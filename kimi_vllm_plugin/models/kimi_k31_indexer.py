"""The DSA lightning indexer of one K3.1 MLA layer (``self_attn.indexer``), as vLLM modules.

Weights (HF names under ``...self_attn.indexer.``, written by ``kimi-rl make-tiny --model k31``):
``wq_b [n_h*d, q_lora_rank]``, ``wk [d, hidden]``, ``k_norm`` LayerNorm weight and bias ``[d]``,
``weights_proj [n_h, hidden]``. For query t and key s <= t (``docs/models.md``, K3.1;
DeepSeek-V3.2's indexer without RoPE, Hadamard rotation and fp8, all [I] for K3.1)::

    q_{t,h} = wq_b(qr_t)_h        qr = q_a_layernorm(q_a_proj x): MLA's normalised query latent
    k_s     = LayerNorm(wk x_s)   one key head shared by the index heads (eps 1e-6)
    I_{t,s} = sum_h weights_proj(x_t)_h / sqrt(n_h d) * ReLU(q_{t,h} . k_s)        (fp32)
    keep_t  = the min(index_topk, t+1) visible keys with the highest I_{t,s}

:meth:`KimiK31Indexer.forward` computes this for one sequence with the oracle's functions
(:mod:`kimi_core.reference.indexer`: ``index_keys``, ``index_scores``, ``topk_mask``); this module holds
only the vLLM parameters. The attention that would
consume ``keep`` is not written (see ``models/kimi_k31.py``): with ``max_model_len <= index_topk``
every visible key is kept and the dense MLA is exact.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kimi_core.reference.indexer import INDEXER_K_NORM_EPS, index_keys, index_scores, topk_mask

__all__ = ["KimiK31Indexer", "K_NORM_EPS"]

#: LayerNorm eps of the index keys: the oracle's (DeepSeek-V3.2's reference LayerNorm) [I]
K_NORM_EPS = INDEXER_K_NORM_EPS


class KimiK31Indexer(nn.Module):
    """Parameters and top-k of one layer's indexer; ``config`` is the K3.1 text config."""

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.linear import ReplicatedLinear

        H, r = config.hidden_size, config.q_lora_rank
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        d = self.head_dim
        self.wq_b = ReplicatedLinear(r, self.n_heads * d, bias=False, prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(H, d, bias=False, prefix=f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(d, eps=K_NORM_EPS)
        self.weights_proj = ReplicatedLinear(H, self.n_heads, bias=False, prefix=f"{prefix}.weights_proj")

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: ``x [T, hidden]`` (normed attention input), ``qr [T, q_lora_rank]``.

        :returns: ``(scores [T, T] fp32 with -inf on future keys, keep [T, T] bool)``.
        """
        T = x.shape[0]
        q = self.wq_b(qr)[0].view(1, T, self.n_heads, self.head_dim)
        k = index_keys(self.wk(x)[0].float()[None], self.k_norm.weight, self.k_norm.bias)
        scores = index_scores(q, k, self.weights_proj(x)[0][None])[0]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        keep = topk_mask(scores[None], causal, self.topk)[0]
        return scores.masked_fill(~causal, float("-inf")), keep
