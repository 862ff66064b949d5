"""Group-relative (GRPO) outcome advantages: group-mean baseline, optional group-std scaling.

Two host conventions, chosen with ``style`` (both use the unbiased std, ``eps = 1e-6``):

- ``"skyrl"`` (``compute_grpo_outcome_advantage``): a group of one gets mean 0 and std 1;
  ``A = (r - mean) / (std + eps)`` (or ``r - mean`` without std normalisation).
- ``"miles"`` (``_normalize_rewards_by_rollout``): ``A = r - mean``; divided by ``std + eps`` only
  when the group has more than one sample and ``std > 0`` (``--disable-grpo-std-normalization``
  turns the division off, which score centering requires).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_ids_from_size", "group_advantages"]

STYLES = ("skyrl", "miles")


def group_ids_from_size(n: int, group_size: int) -> torch.Tensor:
    """``[n]`` int64 group ids ``0,0,..,1,1,..`` for ``n`` samples in consecutive groups of ``group_size``."""
    if group_size <= 0 or n % group_size:
        raise ValueError(f"n_samples_per_prompt={group_size} must be > 0 and divide the batch size {n}")
    return torch.arange(n // group_size).repeat_interleave(group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    style: str = "skyrl",
) -> torch.Tensor:
    """Per-sample GRPO advantage.

    :param rewards: ``[N]`` float scalar reward per response.
    :param group_ids: ``[N]`` group (prompt) id per response; any hashable ids (ints, strings).
    :param norm_by_std: divide by the group std (SkyRL ``grpo_norm_by_std``, miles
        ``grpo_std_normalization``); False gives the group-mean ("Dr. GRPO") advantage.
    :param eps: added to the std.
    :param style: ``"skyrl"`` or ``"miles"`` (singleton and zero-std groups differ, see module doc).
    :returns: ``[N]`` advantages in ``rewards``' float dtype (float64 math inside). Broadcast to tokens
        with ``adv[:, None] * mask``.
    """
    if style not in STYLES:
        raise ValueError(f"group_advantages style={style!r}; expected one of {STYLES}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(ids)} entries, rewards has {rewards.shape[0]}")
    r = rewards.detach().double()
    out = torch.empty_like(r)
    groups: dict = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    for members in groups.values():
        idx = torch.tensor(members)
        x = r[idx]
        if x.numel() == 1:
            mean, std = (
                (torch.zeros((), dtype=r.dtype), torch.ones((), dtype=r.dtype)) if style == "skyrl" else (x[0], None)
            )
        else:
            mean, std = x.mean(), x.std()
        a = x - mean
        if norm_by_std and std is not None:
            if style == "skyrl" or std > 0:
                a = a / (std + eps)
        out[idx] = a
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
