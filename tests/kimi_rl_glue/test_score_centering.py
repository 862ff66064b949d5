"""Score centering (kimi_rl_glue/losses/score_centering.py) against float64 oracles written from miles.md section 6."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.score_centering import importance_weight, score_centering_from_logits, score_centering_loss

EPS = 1e-6


def _f(x: float, mode: str, c: float, lo: float, hi: float) -> float:
    if mode == "none":
        return 1.0
    if mode == "tis":
        return min(x, c)
    return x if lo <= x <= hi else 0.0


def _problem(seed: int, N: int, V: int, K: int, pad_rows: int = 1):
    """Random logits, sampler distribution q, top-K ids (padded with -1 on some rows), sampled tokens, A."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 1.5, -1)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    for i in range(min(pad_rows, N)):
        ids[i, -1] = -1
    tokens = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    q_head = torch.where(
        ids >= 0, q.gather(1, ids.clamp(min=0)).log(), torch.full(ids.shape, -math.inf, dtype=torch.float64)
    )
    q_tok = q.gather(1, tokens[:, None]).squeeze(1).log()
    return z, q, ids, tokens, adv, q_head, q_tok


def _loop_loss(z, ids, tokens, adv, q_head, q_tok, mode, c, lo, hi):
    """Per-token loss from the section-6 formula, one token and one candidate at a time, in Python floats."""
    out = []
    for i in range(z.shape[0]):
        p = torch.softmax(z[i], -1).tolist()
        H = [(int(v), math.exp(float(lq))) for v, lq in zip(ids[i], q_head[i]) if int(v) >= 0]
        pH, qH = sum(p[v] for v, _ in H), sum(qv for _, qv in H)
        rho = max(1 - qH, EPS) / max(1 - pH, EPS)
        alpha = rho * _f(1 / rho, mode, c, lo, hi)
        a = int(tokens[i])
        qa = math.exp(float(q_tok[i]))
        term = _f(p[a] / qa, mode, c, lo, hi) * math.log(p[a])
        corr = sum((qv * _f(p[v] / qv, mode, c, lo, hi) - alpha * p[v]) * math.log(p[v]) for v, qv in H)
        out.append(-float(adv[i]) * (term - corr))
    return torch.tensor(out, dtype=torch.float64)


def _analytic_grad(z, ids, tokens, adv, q_head, q_tok, mode, c, lo, hi):
    """d loss / d logits = -A (w_a s_a - mu_w), mu_w = E_{q_hat}[w s], q_hat = q on H and rho p off H."""
    N, V = z.shape
    grad = torch.zeros_like(z)
    for i in range(N):
        p = torch.softmax(z[i], -1)
        eye = torch.eye(V, dtype=torch.float64)
        s = eye - p[None, :]  # s[v] = d log p_v / d z
        H = {int(v): math.exp(float(lq)) for v, lq in zip(ids[i], q_head[i]) if int(v) >= 0}
        pH, qH = sum(float(p[v]) for v in H), sum(H.values())
        rho = max(1 - qH, EPS) / max(1 - pH, EPS)
        mu = torch.zeros(V, dtype=torch.float64)
        for v in range(V):
            qhat = H[v] if v in H else rho * float(p[v])
            w = _f(float(p[v]) / qhat, mode, c, lo, hi)
            mu += qhat * w * s[v]
        a = int(tokens[i])
        wa = _f(float(p[a]) / math.exp(float(q_tok[i])), mode, c, lo, hi)
        grad[i] = -float(adv[i]) * (wa * s[a] - mu)
    return grad


MODES = [
    pytest.param("none", 2.0, 0.5, 5.0, id="none"),
    pytest.param("tis", 1.3, 0.5, 5.0, id="tis-c1.3"),
    pytest.param("mis", 2.0, 0.7, 1.6, id="mis-0.7-1.6"),
]
SHAPES = [pytest.param(6, 7, 3, id="N6-V7-K3"), pytest.param(13, 11, 5, id="N13-V11-K5")]


@pytest.mark.parametrize("mode,c,lo,hi", MODES)
@pytest.mark.parametrize("N,V,K", SHAPES)
def test_loss_matches_float64_loop(mode, c, lo, hi, N, V, K):
    """The per-token loss equals the section-6 formula evaluated candidate by candidate in float64."""
    z, q, ids, tokens, adv, q_head, q_tok = _problem(0, N, V, K)
    got, metrics, _ = score_centering_from_logits(
        z, tokens, ids, q_tok, q_head, adv, importance=mode, tis_clip=c, mis_low=lo, mis_high=hi
    )
    ref = _loop_loss(z, ids, tokens, adv, q_head, q_tok, mode, c, lo, hi)
    assert_close("sc loss", ref, got, 1e-12)
    assert set(metrics) == {
        "sc_correction",
        "sc_train_head_mass",
        "sc_rollout_head_mass",
        "sc_tail_ratio",
        "sc_importance_weight",
    }


@pytest.mark.parametrize("mode,c,lo,hi", MODES)
@pytest.mark.parametrize("N,V,K", SHAPES)
def test_gradient_is_centered_score(mode, c, lo, hi, N, V, K):
    """Autograd of the loss w.r.t. the logits equals -A (w_a s_a - E_{q_hat}[w s]) on a small vocabulary."""
    z, q, ids, tokens, adv, q_head, q_tok = _problem(1, N, V, K)
    z = z.clone().requires_grad_(True)
    loss, _, _ = score_centering_from_logits(
        z, tokens, ids, q_tok, q_head, adv, importance=mode, tis_clip=c, mis_low=lo, mis_high=hi
    )
    loss.sum().backward()
    ref = _analytic_grad(z.detach(), ids, tokens, adv, q_head, q_tok, mode, c, lo, hi)
    assert_close("sc grad", ref, z.grad, 1e-10)


@pytest.mark.parametrize("mode,c,lo,hi", MODES)
def test_centered_gradient_has_zero_mean_for_constant_advantage(mode, c, lo, hi):
    """When the sampler's tail really is rho*p, the gradient averaged over a ~ q with a constant A is zero (no drift)."""
    N, V, K = 4, 9, 4
    z, q, ids, tokens, adv, q_head, q_tok = _problem(2, N, V, K, pad_rows=0)
    p = torch.softmax(z, -1)
    # Make q's tail proportional to p's so that q_hat == q exactly.
    head = torch.zeros(N, V, dtype=torch.bool).scatter_(1, ids, True)
    qH = (q * head).sum(-1, keepdim=True)
    pT = (p * ~head).sum(-1, keepdim=True)
    q = torch.where(head, q, (1 - qH) * p / pT)
    q_head = q.gather(1, ids).log()
    total = torch.zeros(N, V, dtype=torch.float64)
    for a in range(V):
        zz = z.clone().requires_grad_(True)
        tok = torch.full((N,), a)
        loss, _, _ = score_centering_from_logits(
            zz,
            tok,
            ids,
            q.gather(1, tok[:, None]).squeeze(1).log(),
            q_head,
            torch.ones(N, dtype=torch.float64),
            importance=mode,
            tis_clip=c,
            mis_low=lo,
            mis_high=hi,
        )
        loss.sum().backward()
        total += q[:, a : a + 1] * zz.grad
    assert total.abs().max().item() < 1e-12, f"expected zero drift, got max |E grad| {total.abs().max().item():.3e}"


def test_full_head_on_policy_is_reinforce():
    """With q = p and every token a candidate (K = V, f = none) the loss is plain REINFORCE: -A log p_a."""
    N, V = 5, 6
    g = torch.Generator().manual_seed(3)
    z = torch.randn(N, V, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(z, -1)
    ids = torch.arange(V).expand(N, V)
    tok = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    loss, m, _ = score_centering_from_logits(z, tok, ids, logp.gather(1, tok[:, None]).squeeze(1), logp, adv)
    assert_close("reinforce", -adv * logp.gather(1, tok[:, None]).squeeze(1), loss, 1e-12)
    assert_close("tail ratio", torch.ones(N, dtype=torch.float64), m["sc_tail_ratio"], 1e-12)


def test_importance_weight_closed_forms():
    """importance_weight gives 1, min(x, c) and x*1[lo<=x<=hi] of x = exp(log_ratio) without overflow."""
    lr = torch.tensor([-3.0, -0.5, 0.0, 0.4, 1.0, 800.0], dtype=torch.float64)
    x = [math.exp(v) if v < 700 else math.inf for v in lr.tolist()]
    assert importance_weight(lr, "none").tolist() == [1.0] * 6
    assert_close(
        "tis", torch.tensor([min(v, 2.0) for v in x], dtype=torch.float64), importance_weight(lr, "tis"), 1e-15
    )
    ref = torch.tensor([v if 0.5 <= v <= 5.0 else 0.0 for v in x], dtype=torch.float64)
    assert_close("mis", ref, importance_weight(lr, "mis"), 1e-15)


def test_float32_and_padding_are_finite():
    """float32 inputs with -inf padded candidates give a finite float32 loss and finite gradients."""
    z, q, ids, tokens, adv, q_head, q_tok = _problem(4, 8, 10, 4, pad_rows=8)
    z32 = z.float().requires_grad_(True)
    loss, m, lp = score_centering_from_logits(z32, tokens, ids, q_tok.float(), q_head.float(), adv.float())
    loss.sum().backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all() and torch.isfinite(z32.grad).all()
    ref, _, _ = score_centering_from_logits(z, tokens, ids, q_tok, q_head, adv)
    assert_close("fp32 vs fp64", ref, loss, 1e-5)


def test_errors_name_the_tensor_and_flag():
    """Bad shapes, ids and modes raise ValueError naming the tensor or the flag."""
    z, q, ids, tokens, adv, q_head, q_tok = _problem(5, 3, 5, 2)
    with pytest.raises(ValueError, match="score-centering-is"):
        score_centering_from_logits(z, tokens, ids, q_tok, q_head, adv, importance="ppo")
    with pytest.raises(ValueError, match="topk_ids"):
        score_centering_from_logits(z, tokens, ids + 10, q_tok, q_head, adv)
    with pytest.raises(ValueError, match="advantages"):
        score_centering_loss(q_tok, q_head, q_tok, q_head, adv[:2])
    with pytest.raises(ValueError, match="rollout_head_log_probs"):
        score_centering_loss(q_tok, q_head, q_tok, q_head[:, :1], adv)
