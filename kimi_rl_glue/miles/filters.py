"""DAPO dynamic-sampling filter for ``--dynamic-sampling-filter-path kimi_rl_glue.miles.filters.reward_nonzero_std``.

Keeps a prompt group iff its rewards have nonzero std (``kimi_rl_glue.losses.dynamic_sampling``).
miles' signature: ``fn(args, samples, **kw) -> DynamicFilterOutput(keep, reason)``; a group element
may be a ``Sample`` or a list of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_rl_glue.losses.dynamic_sampling import keep_group

__all__ = ["FilterResult", "reward_nonzero_std"]


@dataclass
class FilterResult:
    """Stand-in for miles' ``DynamicFilterOutput`` when miles is not installed (same fields)."""

    keep: bool
    reason: str | None = None


def _flatten(samples):
    for s in samples:
        if isinstance(s, (list, tuple)):
            yield from s
        else:
            yield s


def _reward(args, s) -> float:
    if hasattr(s, "get_reward_value"):
        return float(s.get_reward_value(args))
    r = s.reward
    if isinstance(r, dict):
        key = getattr(args, "reward_key", None)
        if key is None:
            raise ValueError("sample.reward is a dict; set --reward-key to pick the scalar")
        r = r[key]
    return float(r)


def reward_nonzero_std(args, samples, **kwargs):
    """Keep the group unless all its rewards are equal (or it has a single sample)."""
    rewards = [_reward(args, s) for s in _flatten(samples)]
    keep = keep_group(rewards)
    reason = None if keep else f"zero_std_{round(rewards[0], 1) if rewards else 'empty'}"
    try:
        from miles.rollout.filter_hub.base_types import DynamicFilterOutput
    except ImportError:
        return FilterResult(keep, reason)
    return DynamicFilterOutput(keep=keep, reason=reason)
