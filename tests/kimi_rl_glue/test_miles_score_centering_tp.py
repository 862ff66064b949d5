"""miles score centering on sharded logits equals the unsharded loss: TP 2 over gloo (2 processes), CP 2 zigzag
and --allgather-cp layouts (per-token terms, no communication), against the plain per-sample loss in float64.

Run as a script (``python this_file.py RANK PORT OUT``) it is one TP rank of the gloo test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

PROMPTS, RESPS, V, K = [3, 2, 5], [4, 3, 6], 10, 3
TP = 2


def _batch(seed=0):
    """Three packed samples (thd), float64 logits [1, sum(total), V] and miles' per-sample lists."""
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(PROMPTS, RESPS)]
    logits = 3 * torch.randn(1, sum(totals), V, generator=g, dtype=torch.float64)
    toks = [torch.randint(0, V, (t,), generator=g) for t in totals]
    q_all = [torch.log_softmax(2 * torch.randn(r, V, generator=g, dtype=torch.float64), -1) for r in RESPS]
    ids = [torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(r)]) for r in RESPS]
    ids[0][1, -1] = -1
    ids[2][4, 1:] = -1
    head = [
        torch.where(i >= 0, q.gather(1, i.clamp(min=0)), torch.tensor(-torch.inf, dtype=torch.float64))
        for q, i in zip(q_all, ids)
    ]
    rollout = [q.gather(1, t[-r:, None]).squeeze(1) for q, t, r in zip(q_all, toks, RESPS)]
    masks = [torch.ones(r) for r in RESPS]
    masks[0][-1] = 0
    masks[2][2] = 0
    batch = {
        "unconcat_tokens": toks,
        "total_lengths": totals,
        "response_lengths": RESPS,
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(a)) for r, a in zip(RESPS, torch.randn(3, generator=g))],
        "rollout_log_probs": rollout,
        "rollout_topk_token_ids": ids,
        "rollout_topk_log_probs": head,
    }
    return logits, batch


def _args(mode="tis", **kw):
    return Namespace(score_centering_is=mode, qkv_format="thd", rollout_temperature=1.0, **kw)


def _reducer(batch, local_rows=None):
    """miles' sum_of_sample_mean: per sample, masked sum of its local per-token values / whole-sample mask sum.

    ``local_rows[i]``: the response rows of sample i this rank holds, in its local order (all rows without CP).
    """
    rows = local_rows or [list(range(r)) for r in RESPS]

    def f(x):
        parts = x.split([len(r) for r in rows])
        return sum(
            (p * m[r]).sum() / m.sum().clamp(min=1) for p, m, r in zip(parts, batch["loss_masks"], rows, strict=True)
        )

    return f


def _reference(mode="tis"):
    """(loss, grad [1, T, V]) of the plain per-sample loss on the full logits (torch.log_softmax, float64)."""
    from kimi_rl_glue.losses.score_centering import score_centering_from_logits

    logits, batch = _batch()
    y = logits.clone().requires_grad_(True)
    ref, off = 0, 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPS)):
        rows = y[0, off + p - 1 : off + p + r - 1]
        off += p + r
        loss_i, _, _ = score_centering_from_logits(
            rows,
            batch["unconcat_tokens"][i][-r:],
            batch["rollout_topk_token_ids"][i],
            batch["rollout_log_probs"][i],
            batch["rollout_topk_log_probs"][i],
            batch["advantages"][i],
            importance=mode,
        )
        m = batch["loss_masks"][i]
        ref = ref + (loss_i * m).sum() / m.sum()
    ref.backward()
    return ref.detach(), y.grad


def _tp_rank(rank: int, port: int, out: str) -> None:
    """One TP rank: its vocabulary slice of the logits, the loss over the gloo group, loss and slice gradient saved."""
    import torch.distributed as dist

    from kimi_rl_glue.miles.losses import score_centering_loss_sharded
    from kimi_rl_glue.miles.responses import ShardLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        logits, batch = _batch()
        v = V // TP
        x = logits[..., rank * v : (rank + 1) * v].clone().requires_grad_(True)
        layout = ShardLayout(tp_group=dist.group.WORLD, tp_size=TP, tp_rank=rank)
        loss, metrics = score_centering_loss_sharded(_args(), batch, x, _reducer(batch), layout)
        loss.backward()
        torch.save({"loss": loss.detach(), "grad": x.grad, "metrics": metrics}, out)
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_equals_unsharded(tmp_path):
    """Two gloo ranks, each with half of the vocabulary: both return the unsharded loss and metrics, and their
    gradient slices concatenate to the unsharded gradient w.r.t. the logits (float64, 1e-10)."""
    import socket

    from kimi_rl_glue.miles.losses import score_centering_loss

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(TP)]
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), str(port), outs[r]], env=env, cwd=repo)
        for r in range(TP)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * TP, f"TP ranks exited with {codes}"
    got = [torch.load(o, weights_only=False) for o in outs]

    ref_loss, ref_grad = _reference()
    logits, batch = _batch()
    _, ref_metrics = score_centering_loss(_args(), batch, logits, _reducer(batch))
    for r in range(TP):
        torch.testing.assert_close(got[r]["loss"], ref_loss, rtol=1e-10, atol=1e-12)
        for key, val in ref_metrics.items():
            torch.testing.assert_close(got[r]["metrics"][key].to(val.dtype), val, rtol=1e-10, atol=1e-12, msg=key)
    grad = torch.cat([g["grad"] for g in got], dim=-1)
    assert ref_grad.abs().sum() > 0
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def _zigzag_rank(cp: int, rank: int):
    """CP rank ``rank`` of miles' zigzag layout, built from the layout's definition.

    :returns: ``(global_positions, local_rows)``: the packed position of each local logits row (-1 for the
        padding up to ``2 cp`` chunks) and, per sample, the response rows the rank holds in local order.
    """
    pos, rows, off = [], [], 0
    for p, r in zip(PROMPTS, RESPS):
        total = p + r
        chunk = -(-total // (2 * cp))
        mine = []
        for c in (rank, 2 * cp - 1 - rank):
            for q in range(c * chunk, (c + 1) * chunk):
                pos.append(off + q if q < total else -1)
                if p - 1 <= q < total - 1:
                    mine.append(q - (p - 1))
        rows.append(mine)
        off += total
    return pos, rows


def _contiguous_rank(cp: int, rank: int):
    """CP rank ``rank`` of miles' --allgather-cp layout: the packed sequence cut into ``cp`` equal pieces."""
    total = sum(PROMPTS) + sum(RESPS)
    piece = -(-total // cp)
    pos = [q if q < total else -1 for q in range(rank * piece, (rank + 1) * piece)]
    rows, off = [], 0
    for p, r in zip(PROMPTS, RESPS):
        rows.append([q - off - (p - 1) for q in pos if off + p - 1 <= q < off + p + r - 1])
        off += p + r
    return pos, rows


@pytest.mark.parametrize("allgather_cp", [False, True], ids=["zigzag", "allgather_cp"])
def test_cp2_equals_cp1(allgather_cp):
    """Each CP rank's loss over its own tokens (with miles' CP reducer) sums to the CP 1 loss, and the local
    gradients, put back at their packed positions, add up to the CP 1 gradient; padding rows get none."""
    from kimi_rl_glue.miles.losses import score_centering_loss_sharded
    from kimi_rl_glue.miles.responses import ShardLayout

    cp = 2
    ref_loss, ref_grad = _reference()
    logits, batch = _batch()
    total_loss, grad = 0, torch.zeros_like(logits)
    for rank in range(cp):
        pos, rows = (_contiguous_rank if allgather_cp else _zigzag_rank)(cp, rank)
        idx = torch.tensor(pos)
        local = torch.where((idx >= 0)[:, None], logits[0, idx.clamp(min=0)], torch.full((V,), 7.0, dtype=logits.dtype))
        x = local[None].clone().requires_grad_(True)
        layout = ShardLayout(cp_size=cp, cp_rank=rank, allgather_cp=allgather_cp)
        loss, _ = score_centering_loss_sharded(
            _args(allgather_cp=allgather_cp), batch, x, _reducer(batch, rows), layout
        )
        loss.backward()
        total_loss = total_loss + loss.detach()
        assert x.grad[0, idx < 0].abs().sum() == 0
        grad[0].index_add_(0, idx[idx >= 0], x.grad[0, idx >= 0])
    torch.testing.assert_close(total_loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_missing_topk_field_is_named():
    """Without the rollout's top-K fields the loss fails naming the field and the miles flag that records it."""
    from kimi_core.errors import KimiError
    from kimi_rl_glue.miles.losses import MissingRolloutField, score_centering_loss

    logits, batch = _batch()
    for key in ("rollout_topk_token_ids", "rollout_topk_log_probs"):
        with pytest.raises(MissingRolloutField) as err:
            score_centering_loss(_args(), dict(batch, **{key: None}), logits, _reducer(batch))
        assert isinstance(err.value, KimiError)
        assert f"batch[{key!r}]" in str(err.value) and "--rollout-top-logprobs-num" in str(err.value)
        assert not str(err.value).startswith('"')


if __name__ == "__main__":
    _tp_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
