"""DAPO soft overlong punishment (kimi_rl_glue/losses/overlong.py) against the formula in skyrl.md section 2."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

from kimi_rl_glue.losses.overlong import apply_overlong_penalty


@pytest.mark.parametrize(
    "L_max,L_buf,factor", [(100, 20, 1.0), (4096 * 2, 4096, 0.5)], ids=["100-20-f1", "8192-4096-f0.5"]
)
def test_matches_formula(L_max, L_buf, factor):
    """Inside (L_max - L_buf, L_max] the reward loses (len - (L_max - L_buf)) / L_buf * factor; beyond L_max it is 0."""
    lens = [
        1,
        L_max - L_buf - 1,
        L_max - L_buf,
        L_max - L_buf + 1,
        L_max - L_buf // 2,
        L_max - 1,
        L_max,
        L_max + 1,
        3 * L_max,
    ]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, -0.5]
    ref = []
    for r, n in zip(rewards, lens):
        start = L_max - L_buf
        if n > L_max:
            ref.append(0.0)
        elif n > start:
            ref.append(r - (n - start) / L_buf * factor)
        else:
            ref.append(r)
    got = apply_overlong_penalty(rewards, lens, L_max, L_buf, factor)
    assert_close("overlong", torch.tensor(ref, dtype=torch.float64), got, 1e-15)
    assert got[6].item() == pytest.approx(1.0 - factor)  # exactly at L_max: full penalty


def test_bad_buffer_names_flag():
    """A buffer longer than the max length (or <= 0) raises ValueError naming overlong_buffer_len."""
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        apply_overlong_penalty([1.0], [3], 10, 11)
