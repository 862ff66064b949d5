"""Multi-head latent attention (MLA): K2.x with interleaved RoPE/YaRN, K3 NoPE with a sigmoid output gate.

Equations (DeepSeek-V3 MLA; ``docs/models.md``), per token::

    q   = q_b_proj(RMSNorm(q_a_proj x; q_a_layernorm))            [heads, nope + rope]
    c, k_pe = split(kv_a_proj_with_mqa x, [kv_lora_rank, rope])
    c   = RMSNorm(c; kv_a_layernorm)                               cached latent
    k_nope, v = split(kv_b_proj c, [nope, v_head_dim])             per head
    k   = [k_nope, k_pe]  (k_pe shared by every head)
    K2.x: RoPE on q_pe and k_pe, pairs (x0, x1), (x2, x3)... interleaved (DeepSeek layout,
          transformers ``rope_interleave=True``); YaRN frequencies; softmax scale
          (nope+rope)^-1/2 * mscale(factor, mscale_all_dim)^2.
    K3  : ``mla_use_nope``: no rotation at all; scale (nope+rope)^-1/2.
    o   = softmax(q k^T * scale + causal [+ DSA top-k mask]) v
    K3  : ``mla_use_output_gate``: o = o * sigmoid(g_proj x)  (elementwise over heads*v_head_dim)
    out = o_proj(o)

The cache holds the normalised latent ``c [B, S, kv_lora_rank]`` and the rotated ``k_pe [B, S, rope]``
(DeepSeek's compressed cache); keys/values are re-expanded through ``kv_b_proj`` every call.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kimi_core.reference.indexer import Indexer
from kimi_core.reference.ops import acc_dtype, rms_norm

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig
    from kimi_core.lora.resolve import AdapterLookup
    from kimi_core.reference.weights import Weights

__all__ = ["MLA_LATENT_NORM_EPS", "MLALayer", "latent_norm_eps", "rope_tables", "apply_rope_interleaved", "yarn_mscale"]

# Eps of the two MLA latent norms (q_a_layernorm, kv_a_layernorm). None = use config.rms_norm_eps,
# the vLLM / SGLang convention (the engines we must match). transformers' DeepseekV3 and
# KimiLinear hard-code 1e-6 here instead (~1e-5 relative difference; see ENVIRONMENT.md).
MLA_LATENT_NORM_EPS: float | None = None


def latent_norm_eps(config: KimiConfig, override: float | None = None) -> float:
    """The latent-norm eps in use: ``override``, else :data:`MLA_LATENT_NORM_EPS`, else ``rms_norm_eps``."""
    if override is not None:
        return override
    return config.rms_norm_eps if MLA_LATENT_NORM_EPS is None else MLA_LATENT_NORM_EPS


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_type(rs: dict | None) -> str:
    if not rs:
        return "default"
    return rs.get("rope_type") or rs.get("type") or "default"


def rope_tables(config: KimiConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(cos, sin)`` of shape ``[T, rope/2]`` (fp64) for the K2.x rotary part, and the softmax-scale factor.

    YaRN per the DeepSeek-V3 / transformers ``_compute_yarn_parameters`` formulas: per-frequency
    ramp between interpolation (``1/(factor*base^(2i/d))``) and extrapolation, correction range
    from ``beta_fast``/``beta_slow`` floored/ceiled; cos/sin scaled by
    ``mscale(factor, mscale)/mscale(factor, mscale_all_dim)``; the softmax scale multiplied by
    ``mscale(factor, mscale_all_dim)^2`` [I] (as vLLM and transformers do).
    """
    d = config.qk_rope_head_dim
    base = config.rope_theta
    rs = config.rope_scaling
    exps = torch.arange(0, d, 2, dtype=torch.float64) / d
    inv = 1.0 / base**exps
    cos_scale, score_scale = 1.0, 1.0
    kind = _rope_type(rs)
    if kind == "yarn":
        factor = float(rs["factor"])
        omax = float(rs.get("original_max_position_embeddings", 4096))
        bf, bs = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)
        ms, msa = rs.get("mscale"), rs.get("mscale_all_dim")

        def corr_dim(rot: torch.Tensor):
            return d * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = max(math.floor(corr_dim(bf)), 0), min(math.ceil(corr_dim(bs)), d - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1.0 - ramp  # 1 = keep the original (extrapolated) frequency
        inv = (inv / factor) * (1 - extra) + inv * extra
        if ms and msa:
            cos_scale = yarn_mscale(factor, ms) / yarn_mscale(factor, msa)
        else:
            cos_scale = yarn_mscale(factor)
        if msa:
            score_scale = yarn_mscale(factor, msa) ** 2
    elif kind != "default":
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported by the reference (yarn or none)")
    ang = positions.to(torch.float64)[:, None] * inv.to(positions.device)[None]
    return ang.cos() * cos_scale, ang.sin() * cos_scale, score_scale


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` by angle i. ``x [..., T, rope]``, ``cos``/``sin`` ``[T, rope/2]``."""
    xe, xo = x[..., 0::2], x[..., 1::2]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack([xe * c - xo * s, xo * c + xe * s], dim=-1).flatten(-2)


class MLALayer:
    """One MLA ``self_attn`` block with HF names under ``prefix`` (ends with ``self_attn``).

    Cache (dict): ``c [B, S, kv_lora_rank]``, ``k_pe [B, S, rope]``, ``pos`` (tokens seen), and the
    indexer's ``idx_k`` for K3.1.
    """

    def __init__(self, config: KimiConfig, weights: Weights, prefix: str, latent_eps: float | None = None):
        self.cfg, self.w, self.p = config, weights, prefix
        self.nh = config.num_attention_heads
        self.dn, self.dr, self.dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.eps = latent_norm_eps(config, latent_eps)
        self.use_rope = not config.mla_use_nope
        self.indexer = Indexer(config, weights, prefix) if config.has_indexer else None

    def __call__(
        self, x: torch.Tensor, cache: dict | None = None, adapter: AdapterLookup | None = None
    ) -> torch.Tensor:
        """``x [B, T, hidden]`` (normed attention input) -> ``[B, T, hidden]``; extends ``cache``."""
        cfg, w, p = self.cfg, self.w, self.p
        B, T, _ = x.shape
        cache = {} if cache is None else cache
        p0 = cache.get("pos", 0)
        dt = x.dtype
        if cfg.q_lora_rank:
            qr = rms_norm(w.linear(x, f"{p}.q_a_proj", adapter), w.weight(f"{p}.q_a_layernorm"), self.eps)
            q = w.linear(qr, f"{p}.q_b_proj", adapter)
        else:
            qr, q = None, w.linear(x, f"{p}.q_proj", adapter)
        q = q.view(B, T, self.nh, self.dn + self.dr).transpose(1, 2)  # [B, nh, T, dqk]
        ckv = w.linear(x, f"{p}.kv_a_proj_with_mqa", adapter)
        c, k_pe = ckv.split([cfg.kv_lora_rank, self.dr], dim=-1)
        c = rms_norm(c, w.weight(f"{p}.kv_a_layernorm"), self.eps)
        score_scale = 1.0
        if self.use_rope:
            cos, sin, score_scale = rope_tables(cfg, torch.arange(p0, p0 + T, device=x.device))
            q = torch.cat([q[..., : self.dn], apply_rope_interleaved(q[..., self.dn :], cos, sin)], dim=-1)
            k_pe = apply_rope_interleaved(k_pe, cos, sin)
        if "c" in cache:
            c, k_pe = torch.cat([cache["c"], c], 1), torch.cat([cache["k_pe"], k_pe], 1)
        cache["c"], cache["k_pe"], cache["pos"] = c, k_pe, p0 + T
        S = c.shape[1]
        kv = w.linear(c, f"{p}.kv_b_proj", adapter).view(B, S, self.nh, self.dn + self.dv).transpose(1, 2)
        k = torch.cat([kv[..., : self.dn], k_pe[:, None].expand(B, self.nh, S, self.dr)], dim=-1)
        v = kv[..., self.dn :]
        scale = (self.dn + self.dr) ** -0.5 * score_scale
        logits = (q @ k.transpose(-1, -2)).to(acc_dtype(dt)) * scale  # [B, nh, T, S]
        causal = (
            torch.arange(S, device=x.device)[None, :] <= torch.arange(p0, p0 + T, device=x.device)[:, None]
        )  # [T, S]
        keep = causal
        if self.indexer is not None:
            keep = self.indexer.mask(x, qr, cache, causal, adapter)[:, None]  # [B, 1, T, S]
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1).to(dt)
        o = (probs @ v).transpose(1, 2).reshape(B, T, self.nh * self.dv)
        if cfg.mla_use_output_gate:
            o = o * torch.sigmoid(w.linear(x, f"{p}.g_proj", adapter))
        return w.linear(o, f"{p}.o_proj", adapter)
