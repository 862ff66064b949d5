"""Group advantages (kimi_rl_glue/losses/advantages.py) against per-group loops of the SkyRL and miles rules."""

from __future__ import annotations

import statistics

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.advantages import group_advantages, group_ids_from_size


def _loop(rewards, ids, norm, eps, style):
    out = [0.0] * len(rewards)
    for g in set(ids):
        idx = [i for i, x in enumerate(ids) if x == g]
        xs = [rewards[i] for i in idx]
        if len(xs) == 1:
            mean, std = (0.0, 1.0) if style == "skyrl" else (xs[0], None)
        else:
            mean, std = statistics.fmean(xs), statistics.stdev(xs)
        for i in idx:
            a = rewards[i] - mean
            if norm and std is not None and (style == "skyrl" or std > 0):
                a /= std + eps
            out[i] = a
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("style", ["skyrl", "miles"])
@pytest.mark.parametrize("norm", [True, False], ids=["std", "mean-only"])
def test_matches_loop(style, norm):
    """Advantages equal (r - group mean) [/ (group std + eps)] computed group by group, singletons and ties included."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 0.25, 3.0]
    ids = ["a", "a", "a", "a", "b", "b", "b", "c", "d", "d", "e"]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), ids, norm_by_std=norm, style=style)
    assert_close(f"adv {style}", _loop(rewards, ids, norm, 1e-6, style), got, 1e-14)


def test_group_ids_from_size_and_errors():
    """Consecutive groups of n get ids 0..; a group size that does not divide N or a bad style raises."""
    assert group_ids_from_size(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        group_ids_from_size(5, 2)
    with pytest.raises(ValueError, match="style"):
        group_advantages(torch.zeros(2), [0, 0], style="verl")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), [0, 0])
