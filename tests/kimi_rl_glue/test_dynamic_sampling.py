"""DAPO dynamic-sampling filter (kimi_rl_glue/losses/dynamic_sampling.py) against a per-group loop."""

from __future__ import annotations

import statistics

import torch

from kimi_rl_glue.losses.dynamic_sampling import dynamic_sampling_keep, keep_group


def test_keep_mask_matches_loop():
    """A sample is kept iff its group has at least two rewards and a nonzero (> 1e-8) sample std."""
    rewards = [1, 1, 1, 0, 1, 0, 0.5, 0.5, 2.0, 0.3, 0.3 + 1e-12]
    ids = [0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4]
    got = dynamic_sampling_keep(torch.tensor(rewards, dtype=torch.float64), ids)
    ref = []
    for g in ids:
        xs = [r for r, h in zip(rewards, ids) if h == g]
        ref.append(len(xs) > 1 and statistics.stdev(xs) > 1e-8)
    assert got.tolist() == ref
    assert keep_group([0.0, 1.0]) and not keep_group([1.0]) and not keep_group([0.7] * 8)
