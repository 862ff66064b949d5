"""The demo's token-set task as a skyrl_gym environment (``environment.env_class=kimi_token_set``).

A random tiny model never earns a reward on math; on this task it earns about ``|S| / V`` from the start
and RL raises it, so SkyRL's loop on a tiny checkpoint has non-zero advantages. The response is text
from the tiny checkpoints' word-level tokenizer (:mod:`kimi_core.checkpoint.tokenizer`: id ``i`` is the
word ``w<i>``); its reward is the fraction of its whitespace-separated words whose id lies in the hidden
target set ``S`` (:func:`kimi_rl_glue.demo.task.target_fraction`, the formula of the demo's
``TokenSetTask``). Special tokens and unknown words count as misses.

Each dataset row names its target set in ``reward_model.ground_truth`` (space-separated ``w<i>`` words),
which SkyRL passes to the environment as ``extras`` (``NovaSky-AI/SkyRL:skyrl/train/dataset/dataset.py``:
every column but ``prompt`` and ``env_class``). ``kimi-rl prepare-data --format skyrl --task token-set``
writes such rows. The pattern is ``skyrl_gym/envs/aime/env.py``: one step, then done.

skyrl_gym is imported at module import (the class subclasses its ``BaseTextEnv``); SkyRL loads this
module by its entry point string, and :func:`register_token_set_env` is what a host calls.
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from kimi_core.checkpoint.tokenizer import word_id
from kimi_rl_glue.data import TOKEN_SET_ENV
from kimi_rl_glue.demo.task import target_fraction

__all__ = ["ENV_ID", "ENTRY_POINT", "TokenSetEnv", "parse_targets", "register_token_set_env"]

ENV_ID = TOKEN_SET_ENV  # "kimi_token_set", the env_class the rows of prepare-data name
ENTRY_POINT = f"{__name__}:TokenSetEnv"


def parse_targets(ground_truth: Any) -> frozenset[int]:
    """The target ids of a ``ground_truth`` string of space-separated ``w<i>`` words.

    :raises ValueError: not a non-empty string, or a word that is not ``w<i>`` (the word is named).
    """
    if not isinstance(ground_truth, str) or not ground_truth.split():
        raise ValueError(
            f"{ENV_ID}: reward_model.ground_truth must be a non-empty string of space-separated w<i> words, "
            f"got {ground_truth!r}"
        )
    ids = []
    for w in ground_truth.split():
        i = word_id(w)
        if i is None:
            raise ValueError(f"{ENV_ID}: reward_model.ground_truth word {w!r} is not a word w<i> of the tokenizer")
        ids.append(i)
    return frozenset(ids)


class TokenSetEnv(BaseTextEnv):
    """One-step environment: reward = fraction of the response's words in the row's target set.

    :param env_config: unused (SkyRL passes ``environment.skyrl_gym.kimi_token_set``, if any).
    :param extras: the dataset row's other columns; ``extras["reward_model"]["ground_truth"]`` is required.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        reward_model = (extras or {}).get("reward_model")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise ValueError(
                f"{ENV_ID}: the dataset row has no reward_model.ground_truth (the target words); "
                "write the data with `kimi-rl prepare-data --format skyrl --task token-set`"
            )
        self.targets = parse_targets(reward_model["ground_truth"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Score ``action`` (the decoded response) and end the episode."""
        self.turns += 1
        ids = [word_id(w) for w in action.split()]
        reward = target_fraction(ids, self.targets)
        metadata = {"words": len(ids), "hits": round(reward * len(ids))}
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata=metadata)


def register_token_set_env() -> None:
    """Register :class:`TokenSetEnv` as ``kimi_token_set`` in skyrl_gym's registry; a second call does nothing.

    :raises ValueError: ``kimi_token_set`` is already registered to another entry point.
    """
    from skyrl_gym.envs.registration import register, registry

    have = registry.get(ENV_ID)
    if have is None:
        register(id=ENV_ID, entry_point=ENTRY_POINT)
    elif have.entry_point not in (ENTRY_POINT, TokenSetEnv):
        raise ValueError(f"skyrl_gym env {ENV_ID!r} is already registered to {have.entry_point!r}, not {ENTRY_POINT}")
