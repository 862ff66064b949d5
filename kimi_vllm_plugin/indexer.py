"""The DSA lightning indexer of one K3.1 MLA layer (``self_attn.indexer``), as vLLM modules.

Weights (HF names under ``...self_attn.indexer.``, written by ``kimi-rl make-tiny --model k31``):
``wq_b [n_h*d, q_lora_rank]``, ``wk [d, hidden]``, ``k_norm`` LayerNorm weight and bias ``[d]``,
``weights_proj [n_h, hidden]``. For query t and key s <= t (``shared/reference/kimi_arch.md``
section 4; DeepSeek-V3.2's indexer without RoPE, Hadamard rotation and fp8, all [I] for K3.1)::

    q_{t,h} = wq_b(qr_t)_h        qr = q_a_layernorm(q_a_proj x): MLA's normalised query latent
    k_s     = LayerNorm(wk x_s)   one key head shared by the index heads (eps 1e-6)
    I_{t,s} = sum_h weights_proj(x_t)_h / sqrt(n_h d) * ReLU(q_{t,h} . k_s)        (fp32)
    keep_t  = the min(index_topk, t+1) visible keys with the highest I_{t,s}

:meth:`KimiK31Indexer.forward` computes this for one sequence in torch. The attention that would
consume ``keep`` is not written (see ``models/kimi_k31.py``): with ``max_model_len <= index_topk``
every visible key is kept and the dense MLA is exact.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["KimiK31Indexer", "K_NORM_EPS"]

#: LayerNorm eps of the index keys (DeepSeek-V3.2's reference LayerNorm) [I]
K_NORM_EPS = 1e-6


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
        q = self.wq_b(qr)[0].float().view(T, self.n_heads, self.head_dim)
        k = nn.functional.layer_norm(self.wk(x)[0].float(), (self.head_dim,), self.k_norm.weight.float(),
                                     self.k_norm.bias.float(), self.k_norm.eps)
        w = self.weights_proj(x)[0].float() * (self.n_heads * self.head_dim) ** -0.5
        scores = torch.einsum("th,tsh->ts", w, torch.relu(torch.einsum("thd,sd->tsh", q, k)))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        keep = torch.zeros_like(causal)
        keep.scatter_(-1, scores.topk(min(self.topk, T), dim=-1).indices, True)
        return scores, keep & causal
