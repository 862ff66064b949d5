"""DAPO dynamic sampling: keep a prompt group only if its rewards are not all equal.

Same rule as miles' ``check_reward_nonzero_std`` (keep iff the unbiased std of the group's rewards is
``> 1e-8``; a group of one has no std and is dropped) and SkyRL's
``trainer.algorithm.dynamic_sampling.type=filter``. A group with identical rewards has zero GRPO
advantage, so it adds no gradient and only dilutes the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["keep_group", "dynamic_sampling_keep"]

STD_TOL = 1e-8


def keep_group(rewards: Sequence[float] | torch.Tensor, tol: float = STD_TOL) -> bool:
    """True iff ``std(rewards) > tol`` (unbiased std, float64); False for fewer than two rewards."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() < 2:
        return False
    return bool(r.std() > tol)


def dynamic_sampling_keep(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence, tol: float = STD_TOL
) -> torch.Tensor:
    """Per-sample keep mask: ``[N]`` bool, True for samples whose group passes :func:`keep_group`.

    :param rewards: ``[N]`` scalar rewards. :param group_ids: ``[N]`` prompt-group id per sample.
    """
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(ids)} entries, rewards has {rewards.shape[0]}")
    groups: dict = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    keep = torch.zeros(len(ids), dtype=torch.bool)
    for members in groups.values():
        if keep_group(rewards[torch.tensor(members)], tol):
            keep[torch.tensor(members)] = True
    return keep
