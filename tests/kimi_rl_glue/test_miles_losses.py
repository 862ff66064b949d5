"""miles custom losses (kimi_rl_glue/miles/losses.py) on a hand-built packed batch, against the plain-tensor losses."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.policy import policy_loss
from kimi_rl_glue.losses.score_centering import score_centering_from_logits
from kimi_rl_glue.miles.losses import dapo_loss, score_centering_loss

PROMPTS, RESPS, V, K = [3, 2, 5], [4, 3, 1], 9, 3


def _batch(seed=0):
    """Three packed samples (thd): logits [1, sum(total), V] and miles' per-sample lists."""
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(PROMPTS, RESPS)]
    logits = torch.randn(1, sum(totals), V, generator=g, dtype=torch.float64)
    toks = [torch.randint(0, V, (t,), generator=g) for t in totals]
    q_all = [torch.log_softmax(torch.randn(r, V, generator=g, dtype=torch.float64), -1) for r in RESPS]
    ids = [torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(r)]) for r in RESPS]
    ids[0][1, -1] = -1
    head = [
        torch.where(i >= 0, q.gather(1, i.clamp(min=0)), torch.tensor(-torch.inf, dtype=torch.float64))
        for q, i in zip(q_all, ids)
    ]
    rollout = [q.gather(1, t[-r:, None]).squeeze(1) for q, t, r in zip(q_all, toks, RESPS)]
    masks = [torch.ones(r) for r in RESPS]
    masks[0][-1] = 0
    batch = {
        "unconcat_tokens": toks,
        "total_lengths": totals,
        "response_lengths": RESPS,
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(a)) for r, a in zip(RESPS, torch.randn(3, generator=g))],
        "rollout_log_probs": rollout,
        "rollout_topk_token_ids": ids,
        "rollout_topk_log_probs": head,
        "log_probs": [x + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in rollout],
    }
    return logits, batch


def _sum_of_sample_mean(batch):
    """miles' reducer with context parallelism off: sum over samples of the masked per-sample mean."""

    def f(x):
        return sum(
            (xi * m).sum() / m.sum().clamp(min=1)
            for xi, m in zip(x.split(batch["response_lengths"]), batch["loss_masks"])
        )

    return f


def _response_rows(logits, batch, i):
    """Logit rows predicting sample i's response tokens: position (offset + prompt + r - 1) predicts token r."""
    off = sum(batch["total_lengths"][:i])
    return torch.stack([logits[0, off + PROMPTS[i] + r - 1] for r in range(RESPS[i])])


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_score_centering_matches_per_sample_plain_loss(mode):
    """The miles loss equals the plain loss on each sample's response rows, reduced by sum_of_sample_mean, with grads."""
    logits, batch = _batch()
    x = logits.clone().requires_grad_(True)
    args = Namespace(score_centering_is=mode, qkv_format="thd", rollout_temperature=1.0)
    got, metrics = score_centering_loss(args, batch, x, _sum_of_sample_mean(batch))
    got.backward()
    y = logits.clone().requires_grad_(True)
    ref = 0
    for i in range(3):
        rows = _response_rows(y, batch, i)
        loss_i, _, _ = score_centering_from_logits(
            rows,
            batch["unconcat_tokens"][i][-RESPS[i] :],
            batch["rollout_topk_token_ids"][i],
            batch["rollout_log_probs"][i],
            batch["rollout_topk_log_probs"][i],
            batch["advantages"][i],
            importance=mode,
        )
        m = batch["loss_masks"][i]
        ref = ref + (loss_i * m).sum() / m.sum()
    ref.backward()
    assert_close("miles sc loss", ref.detach().reshape(1), got.detach().reshape(1), 1e-12)
    assert_close("miles sc grad", y.grad, x.grad, 1e-12)
    for key in (
        "sc_tail_ratio",
        "sc_importance_weight",
        "train_rollout_kl",
        "train_rollout_logprob_abs_diff",
        "pg_loss",
    ):
        assert metrics[key].dim() == 0 and not metrics[key].requires_grad


@pytest.mark.parametrize("tis", [None, "token", "sequence"])
def test_dapo_loss_equals_sequence_mean_times_batch(tis):
    """With miles' per-sample-mean reducer the DAPO loss is B x the plain sequence_mean loss on the padded batch."""
    logits, batch = _batch(1)
    x = logits.clone().requires_grad_(True)
    args = Namespace(
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        use_rollout_logprobs=False,
        qkv_format="thd",
        rollout_temperature=1.0,
        tis_ratio_type=tis,
        token_tis_ratio_clip_high=1.2,
        sequence_tis_ratio_clip_high=1.5,
    )
    got, metrics = dapo_loss(args, batch, x, _sum_of_sample_mean(batch))
    got.backward()
    y = logits.clone().requires_grad_(True)
    R = max(RESPS)

    def pad(xs, fill=0.0):
        out = torch.full((3, R), fill, dtype=torch.float64)
        for i, t in enumerate(xs):
            out[i, : t.shape[0]] = t
        return out

    lps = [
        torch.log_softmax(_response_rows(y, batch, i), -1)
        .gather(1, batch["unconcat_tokens"][i][-RESPS[i] :, None])
        .squeeze(1)
        for i in range(3)
    ]
    lp = torch.zeros(3, R, dtype=torch.float64)
    for i in range(3):
        lp = lp.index_put((torch.tensor([i] * RESPS[i]), torch.arange(RESPS[i])), lps[i])
    ref, _ = policy_loss(
        lp,
        pad(batch["log_probs"]),
        pad(batch["advantages"]),
        pad(batch["loss_masks"]),
        pad(batch["rollout_log_probs"]),
        eps_low=0.2,
        eps_high=0.28,
        clip_ratio_c=3.0,
        reduction="sequence_mean",
        tis_type=tis,
        token_tis_cap=1.2,
        sequence_tis_cap=1.5,
    )
    (3 * ref).backward()
    assert_close("miles dapo loss", (3 * ref).detach().reshape(1), got.detach().reshape(1), 1e-12)
    assert_close("miles dapo grad", y.grad, x.grad, 1e-12)
    assert {"pg_clipfrac", "ppo_kl", "train_rollout_kl", "train_rollout_logprob_abs_diff"} <= set(metrics)


def test_missing_keys_and_legacy_tis_flag_are_clear():
    """Score centering without top-K data, and --use-tis without tis_ratio_type, fail naming what to set."""
    logits, batch = _batch()
    args = Namespace(qkv_format="thd", rollout_temperature=1.0, use_tis=True)
    b = dict(batch, rollout_topk_token_ids=None)
    with pytest.raises(KeyError, match="rollout-top-logprobs-num"):
        score_centering_loss(args, b, logits, _sum_of_sample_mean(batch))
    with pytest.raises(ValueError, match="tis_ratio_type"):
        dapo_loss(args, batch, logits, _sum_of_sample_mean(batch))
