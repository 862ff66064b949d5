"""Kimi Delta Attention (KDA): gates, recurrent and chunked kernels, and the K3 / Kimi-Linear layer.

Equations from ``docs/models.md`` (sources: fla-org/flash-linear-attention
``fla/ops/kda/naive.py`` and ``gate.py``, ``fla/layers/kda.py``; radixark/miles and
NVIDIA-NeMo/Megatron-Bridge Kimi K3 layers). Per head, with fp32 state ``S [K, V]``::

    S_t = diag(exp(g_t)) S_{t-1}                        # channel-wise decay first
    S_t = S_t + (beta_t k_t) (v_t - k_t^T S_t)^T        # delta rule against the decayed state
    o_t = (scale q_t)^T S_t                             # read-out of the updated state

:func:`recurrent_kda` is the step loop (ground truth, also the decode path); :func:`chunk_kda` is
the chunked (WY / UT) form with chunk 64 and any ``T``. Both take and return the same tensors as
fla's ``naive_recurrent_kda``: ``(q, k, v, g, beta, scale, initial_state, output_final_state) ->
(o, final_state)``.

Chunked form, per chunk with ``G = cumsum(g)`` (per channel), ``Γ = exp(G)`` and start state ``S0``::

    A[j, i] = beta_j * sum_c k_jc k_ic exp(G_jc - G_ic)        for i < j   (strictly lower)
    u       = (I + A)^{-1} (beta V - beta (K ⊙ Γ) S0)           # the delta-rule corrections
    o_r     = (q_r ⊙ Γ_r)^T S0 + sum_{j<=r} (sum_c q_rc k_jc exp(G_rc - G_jc)) u_j
    S_end   = diag(Γ_last) S0 + sum_j (k_j ⊙ exp(G_last - G_j)) u_j^T

which is the recurrence unrolled over the chunk (derived here, not ported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kimi_core.reference.ops import acc_dtype, l2norm, rms_norm

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig
    from kimi_core.lora.resolve import AdapterLookup
    from kimi_core.reference.weights import Weights

__all__ = [
    "kda_gate",
    "softplus_gate",
    "lower_bound_gate",
    "recurrent_kda",
    "chunk_kda",
    "causal_conv",
    "KDALayer",
    "unpad_a_log",
]


# ---------------------------------------------------------------------------------------------- gates
def softplus_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear gate ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.

    :param f: ``[..., H, K]`` decay input (``f_b_proj(f_a_proj(x))``).
    :param A_log: ``[H]``; ``dt_bias``: ``[H*K]``. Returns fp32 ``[..., H, K]`` (<= 0).
    """
    H = f.shape[-2]
    a = acc_dtype(f.dtype)
    z = f.to(a) + dt_bias.to(a).view(H, -1)
    return -A_log.to(a).exp().view(H, 1) * F.softplus(z)


def lower_bound_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """K3 "safe" gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``; decay in ``(e^lb, 1)``.

    Shapes as :func:`softplus_gate`. ``lower_bound`` is ``linear_attn_config.gate_lower_bound`` (-5.0).
    """
    H = f.shape[-2]
    a = acc_dtype(f.dtype)
    z = f.to(a) + dt_bias.to(a).view(H, -1)
    return lower_bound * torch.sigmoid(A_log.to(a).exp().view(H, 1) * z)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """The gate of a config: lower-bound sigmoid when ``lower_bound`` is set (K3), softplus otherwise."""
    if lower_bound is None:
        return softplus_gate(f, A_log, dt_bias)
    return lower_bound_gate(f, A_log, dt_bias, lower_bound)


def unpad_a_log(A_log: torch.Tensor, num_heads: int, where: str = "A_log") -> torch.Tensor:
    """First ``num_heads`` entries of a (possibly zero-padded) ``A_log`` of any shape -> ``[H]``.

    The K3 release stores ``A_log`` zero-padded to ``head_dim`` (128 for 96 heads); the padding
    must be zero, as the Megatron-Bridge K3 bridge asserts (kimi_arch.md section 0).
    """
    flat = A_log.reshape(-1)
    if flat.numel() < num_heads:
        raise ValueError(f"{where}: has {flat.numel()} entries, need at least num_heads={num_heads}")
    pad = flat[num_heads:]
    if pad.numel() and bool((pad != 0).any()):
        raise ValueError(f"{where}: padding beyond num_heads={num_heads} must be zero, got {pad.tolist()[:8]}...")
    return flat[:num_heads]


# ---------------------------------------------------------------------------------------------- kernels
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"KDA: q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)} must all be [B, T, H, K]")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"KDA: v {tuple(v.shape)} must be [B, T, H, V] and beta {tuple(beta.shape)} [B, T, H]")


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step-loop KDA (the ground truth), same signature as fla's ``naive_recurrent_kda``.

    :param q, k: ``[B, T, H, K]`` (already L2-normalised by the caller if wanted).
    :param v: ``[B, T, H, V]``; ``g``: ``[B, T, H, K]`` log-decay; ``beta``: ``[B, T, H]``.
    :param scale: query scale, default ``K ** -0.5``.
    :param initial_state: ``[B, H, K, V]`` or None (zeros).
    :returns: ``(o [B, T, H, V] in v.dtype, S [B, H, K, V] fp32 or None)``.
    """
    _check(q, k, v, g, beta)
    B, T, H, K = q.shape
    a = acc_dtype(v.dtype)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(a) for t in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, v.shape[-1], dtype=a, device=q.device)
    if initial_state is not None:
        S = S + initial_state.to(a)
    o = torch.empty_like(v)
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * beta[:, t, :, None], v[:, t] - pred)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (module docstring), same signature and results as :func:`recurrent_kda`.

    ``T`` need not be a multiple of ``chunk_size``: the tail is padded with ``k = beta = g = 0``,
    which leaves the state unchanged.
    """
    _check(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    a = acc_dtype(v.dtype)
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    pad = (-T) % C

    # -> [B, H, N, C, *]
    def prep(t):
        t = t.to(a).transpose(1, 2)
        if pad:
            t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.reshape(B, H, -1, C, *t.shape[3:])

    q, k, v, g, beta = prep(q) * scale, prep(k), prep(v), prep(g), prep(beta)
    N = q.shape[2]
    G = g.cumsum(-2)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    strict = torch.tril(incl, diagonal=-1)
    eye = torch.eye(C, dtype=a, device=q.device)
    S = torch.zeros(B, H, K, V, dtype=a, device=q.device)
    if initial_state is not None:
        S = S + initial_state.to(a)
    o = torch.empty(B, H, N, C, V, dtype=a, device=q.device)
    for n in range(N):
        Gn, kn, qn, bn = G[:, :, n], k[:, :, n], q[:, :, n], beta[:, :, n]
        # pairwise decay exp(G_r - G_j) for j <= r, zero above the diagonal (masked before exp)
        diff = (Gn.unsqueeze(-2) - Gn.unsqueeze(-3)).masked_fill(~incl[..., None], float("-inf")).exp()
        Akk = torch.einsum("bhjc,bhic,bhjic->bhji", kn, kn, diff) * bn.unsqueeze(-1)
        Akk = Akk.masked_fill(~strict, 0.0)
        Gam = Gn.exp()
        rhs = bn.unsqueeze(-1) * (v[:, :, n] - (kn * Gam) @ S)
        u = torch.linalg.solve_triangular(eye + Akk, rhs, upper=False, unitriangular=True)
        Aqk = torch.einsum("bhrc,bhjc,bhrjc->bhrj", qn, kn, diff)
        o[:, :, n] = (qn * Gam) @ S + Aqk @ u
        last = Gn[:, :, -1:]
        S = S * Gam[:, :, -1].unsqueeze(-1) + (kn * (last - Gn).exp()).transpose(-1, -2) @ u
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(v.dtype), (S if output_final_state else None)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU (fla ``ShortConvolution``, no bias), with a carried input state.

    :param x: ``[B, T, P]`` new inputs; ``weight``: ``[P, 1, W]`` (fp32 in the releases).
    :param state: ``[B, W-1, P]`` previous inputs (None = zeros, i.e. left zero padding).
    :returns: ``(SiLU(conv(x)) [B, T, P] in acc dtype, new state [B, W-1, P])``.
    """
    B, T, P = x.shape
    W = weight.shape[-1]
    a = acc_dtype(x.dtype)
    if state is None:
        state = torch.zeros(B, W - 1, P, dtype=a, device=x.device)
    xs = torch.cat([state.to(a), x.to(a)], dim=1)  # [B, W-1+T, P]
    y = F.conv1d(xs.transpose(1, 2), weight.to(a).reshape(P, 1, W), groups=P)  # [B, P, T]
    return F.silu(y.transpose(1, 2)), xs[:, xs.shape[1] - (W - 1) :]


# ---------------------------------------------------------------------------------------------- layer
class KDALayer:
    """One KDA ``self_attn`` block with HF weight names under ``prefix`` (ends with ``self_attn``).

    Weights: ``{q,k,v}_proj [P, H]``, ``{q,k,v}_conv1d [P, 1, W]``, ``f_a_proj [K, H]``,
    ``f_b_proj [P, K]``, ``b_proj [heads, H]``, ``g_proj [P, H]`` (K3, ``use_full_rank_gate``) or
    ``g_a_proj [K, H]`` + ``g_b_proj [P, K]`` (Kimi-Linear), ``A_log`` (zero-padded, fp32),
    ``dt_bias [P]`` (fp32), ``o_norm [K]``, ``o_proj [H, P]``; ``P = heads * head_dim``, K = V = head_dim.

    Cache (per layer, dict): ``conv_q/conv_k/conv_v [B, W-1, P]`` and ``S [B, heads, K, V]`` fp32.
    """

    def __init__(self, config: KimiConfig, weights: Weights, prefix: str, mode: str = "chunk"):
        la = config.linear_attn
        self.cfg, self.w, self.p, self.mode = config, weights, prefix, mode
        self.H, self.D = la.num_heads, la.head_dim
        self.lower_bound = la.gate_lower_bound
        self.full_rank_gate = la.use_full_rank_gate
        self.eps = config.rms_norm_eps

    def __call__(
        self, x: torch.Tensor, cache: dict | None = None, adapter: AdapterLookup | None = None
    ) -> torch.Tensor:
        """``x [B, T, hidden]`` (normed attention input) -> ``[B, T, hidden]``; updates ``cache`` in place."""
        w, p, H, D = self.w, self.p, self.H, self.D
        B, T, _ = x.shape
        a = acc_dtype(x.dtype)
        cache = {} if cache is None else cache
        qkv = []
        for n in ("q", "k", "v"):
            y = w.linear(x, f"{p}.{n}_proj", adapter)
            y, cache[f"conv_{n}"] = causal_conv(y, w.tensor(f"{p}.{n}_conv1d.weight", a), cache.get(f"conv_{n}"))
            qkv.append(y.view(B, T, H, D))
        q, k, v = qkv
        q, k = l2norm(q), l2norm(k)
        f = w.linear(w.linear(x, f"{p}.f_a_proj", adapter), f"{p}.f_b_proj", adapter).view(B, T, H, D)
        A_log = unpad_a_log(w.tensor(f"{p}.A_log", a), H, f"{p}.A_log")
        g = kda_gate(f, A_log, w.tensor(f"{p}.dt_bias", a), self.lower_bound)
        beta = torch.sigmoid(w.linear(x, f"{p}.b_proj", adapter).to(a))
        kernel = recurrent_kda if (self.mode == "recurrent" or T == 1) else chunk_kda
        o, cache["S"] = kernel(q, k, v, g, beta, initial_state=cache.get("S"), output_final_state=True)
        if self.full_rank_gate:
            gate = w.linear(x, f"{p}.g_proj", adapter)
        else:
            gate = w.linear(w.linear(x, f"{p}.g_a_proj", adapter), f"{p}.g_b_proj", adapter)
        o = rms_norm(o, w.tensor(f"{p}.o_norm.weight", a), self.eps) * torch.sigmoid(gate.to(a).view(B, T, H, D))
        return w.linear(o.reshape(B, T, H * D).to(x.dtype), f"{p}.o_proj", adapter)
