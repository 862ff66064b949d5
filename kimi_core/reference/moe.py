"""Dense MLP, DeepSeek ``noaux_tc`` router, routed experts (packed, dequantized per layer) and K3 latent MoE.

Equations (``docs/models.md``, K2 and K3 sections)::

    s    = sigmoid(x W_gate^T)                  fp32 [E]   (softmax when scoring_func="softmax")
    pick = top-k(s + e_score_correction_bias)   after keeping the topk_group best groups
                                                (group score = sum of its 2 best biased scores)
    w    = s[pick] / sum s[pick] (norm_topk_prob) * routed_scaling_factor
    K2.x: out = sum_k w_k E_k(x) + Shared(x)
    K3  : z = routed_expert_down_proj(x); y = sum_k w_k E_k(z)
          y = RMSNorm(y; routed_expert_norm) (latent_moe_use_norm, after the weighted sum)
          out = routed_expert_up_proj(y) + Shared(x)
    E(z) = down(act(gate z, up z)),  act = SiLU-GLU (K2.x) or SiTU-GLU (K3)

Expert linears are ``experts.{e}.{gate_proj,up_proj,down_proj}`` (K2.x) or ``experts.{e}.{w1,w3,w2}``
(K3). They stay packed in the checkpoint; each forward dequantizes only the experts the router
picked, exactly, in the model dtype. LoRA on an expert comes from ``adapter.expert(moe, e, proj)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.reference.ops import acc_dtype, glu, linear, rms_norm

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig
    from kimi_core.lora.resolve import AdapterLookup
    from kimi_core.reference.weights import Weights

__all__ = ["route", "replay_route", "DenseMLP", "MoE"]


def route(logits: torch.Tensor, bias: torch.Tensor | None, config: KimiConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek ``noaux_tc`` routing of ``logits [N, E]`` (fp32).

    :returns: ``(weights [N, k] fp32, experts [N, k] int64)``; order within a row is unspecified.
    """
    k, E = config.num_experts_per_tok, config.n_routed_experts
    s = _scores(logits, config)
    choice = s if bias is None else s + bias.to(s.dtype)
    if config.n_group > 1 and config.topk_group < config.n_group:
        grouped = choice.view(-1, config.n_group, E // config.n_group)
        gscore = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(
            -1, gscore.topk(config.topk_group, dim=-1).indices, True
        )
        choice = choice.masked_fill(~keep.repeat_interleave(E // config.n_group, dim=-1), float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    return _gate_weights(s, idx, config), idx


def _scores(logits: torch.Tensor, config: KimiConfig) -> torch.Tensor:
    """Router scores ``[N, E]``: sigmoid (K2.x, K3) or softmax of the logits."""
    return logits.sigmoid() if config.scoring_func == "sigmoid" else logits.softmax(-1)


def _gate_weights(s: torch.Tensor, idx: torch.Tensor, config: KimiConfig) -> torch.Tensor:
    """Gate weights ``[N, k]`` of experts ``idx``: their scores, renormalised, times ``routed_scaling_factor``."""
    wts = s.gather(-1, idx)
    if config.norm_topk_prob:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return wts * config.routed_scaling_factor


def replay_route(logits: torch.Tensor, indices: torch.Tensor, config: KimiConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout routing replay (R3): the experts ``indices [N, k]`` are given (by the rollout
    engine), their gate weights come from this router's ``logits [N, E]``: the scores of
    :func:`route` gathered at ``indices`` (the bias only ever chose experts), renormalised and scaled
    the same way. With ``route``'s own choice it reproduces ``route``; gradients reach ``logits``.

    :returns: ``(weights [N, k] fp32, indices [N, k] int64)``, :func:`route`'s contract.
    """
    if indices.shape != (logits.shape[0], config.num_experts_per_tok):
        raise ValueError(
            f"replay indices have shape {tuple(indices.shape)}, expected "
            f"({logits.shape[0]}, num_experts_per_tok={config.num_experts_per_tok})"
        )
    s = _scores(logits.float(), config)
    idx = indices.long().to(s.device)
    return _gate_weights(s, idx, config), idx


class DenseMLP:
    """``down_proj(act(gate_proj x, up_proj x))`` under ``prefix`` (dense layer-0 MLP or shared experts)."""

    def __init__(self, config: KimiConfig, weights: Weights, prefix: str):
        self.cfg, self.w, self.p = config, weights, prefix

    def __call__(self, x: torch.Tensor, adapter: AdapterLookup | None = None) -> torch.Tensor:
        w, p = self.w, self.p
        h = glu(self.cfg, w.linear(x, f"{p}.gate_proj", adapter), w.linear(x, f"{p}.up_proj", adapter))
        return w.linear(h, f"{p}.down_proj", adapter)


class MoE:
    """One MoE block; ``prefix`` is the full HF module name (``...layers.{i}.mlp`` / ``.block_sparse_moe``)."""

    def __init__(self, config: KimiConfig, weights: Weights, prefix: str):
        self.cfg, self.w, self.p = config, weights, prefix
        self.latent = bool(config.routed_expert_hidden_size)
        self.shared = DenseMLP(config, weights, f"{prefix}.shared_experts") if config.n_shared_experts else None
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (weights, experts) of the last call
        self.replay: torch.Tensor | None = None  # int [N, k]: experts to use instead of routing (R3)

    def experts(
        self, z: torch.Tensor, wts: torch.Tensor, idx: torch.Tensor, adapter: AdapterLookup | None = None
    ) -> torch.Tensor:
        """``sum_k wts[:, k] * E_{idx[:, k]}(z)`` for ``z [N, D]``; returns ``[N, D]`` in ``z.dtype``."""
        w, p, cfg = self.w, self.p, self.cfg
        gate_n, up_n, down_n = cfg.expert_names
        a = acc_dtype(z.dtype)
        out = torch.zeros(z.shape, dtype=a, device=z.device)
        for e in torch.unique(idx).tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            ze = z[rows]
            base = f"{p}.experts.{e}"

            def lin(t, name: str):
                lora = adapter.expert(p, e, name) if adapter is not None else None
                return linear(t, w.expert_weight(f"{base}.{name}"), lora)

            h = glu(cfg, lin(ze, gate_n), lin(ze, up_n))
            out.index_add_(0, rows, lin(h, down_n).to(a) * wts[rows, slot, None].to(a))
        return out.to(z.dtype)

    def __call__(self, x: torch.Tensor, adapter: AdapterLookup | None = None) -> torch.Tensor:
        """``x [B, T, hidden]`` (normed) -> ``[B, T, hidden]``."""
        w, p, cfg = self.w, self.p, self.cfg
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        a = acc_dtype(x.dtype)
        logits = w.linear(xf.to(a), f"{p}.gate", adapter, dtype=a)
        bias_name = f"{p}.gate.e_score_correction_bias"
        bias = w.tensor(bias_name, a) if w.has(bias_name) else None
        wts, idx = route(logits, bias, cfg) if self.replay is None else replay_route(logits, self.replay, cfg)
        self.last_routing = (wts, idx)
        if self.latent:
            z = w.linear(xf, f"{p}.routed_expert_down_proj", adapter)
            y = self.experts(z, wts, idx, adapter)
            if cfg.latent_moe_use_norm:
                y = rms_norm(y, w.weight(f"{p}.routed_expert_norm"), cfg.rms_norm_eps)
            y = w.linear(y, f"{p}.routed_expert_up_proj", adapter)
        else:
            y = self.experts(xf, wts, idx, adapter)
        if self.shared is not None:
            y = y + self.shared(xf, adapter)
        return y.view(shape)
