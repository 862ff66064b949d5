"""The demo's verifiable task: emit tokens from a hidden target set.

Prompts are random token ids drawn outside the target set; the reward of a response is the
fraction of its tokens that lie in the target set ``S`` (``|S| = n_targets`` ids fixed by the seed).
An untrained tiny model spreads its mass over the vocabulary, so the reward starts near
``|S| / V``; LoRA RL raises it by shifting mass onto ``S``. The check is exact (set membership),
so the reward is verifiable, like the math rewards of the real recipes.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch


def target_fraction(response: Sequence, targets: Container) -> float:
    """The task's reward: the fraction of ``response`` tokens that lie in ``targets`` (0.0 for an empty response).

    Shared by :class:`TokenSetTask` (token ids) and SkyRL's ``kimi_token_set`` environment (words mapped to ids).
    """
    return sum(t in targets for t in response) / len(response) if response else 0.0


class TokenSetTask:
    """:param vocab_size: model vocabulary; :param n_targets: ``|S|``; ids below ``first_id`` are never used."""

    def __init__(self, vocab_size: int, seed: int = 0, n_targets: int = 64, prompt_len: int = 8, first_id: int = 3):
        g = torch.Generator().manual_seed(10_000 + seed)
        perm = torch.randperm(vocab_size - first_id, generator=g) + first_id
        self.targets = set(perm[:n_targets].tolist())
        self.others = perm[n_targets:]
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size

    def prompts(self, n: int, generator: torch.Generator) -> list[list[int]]:
        """``n`` prompts of ``prompt_len`` ids, none of them in the target set."""
        idx = torch.randint(len(self.others), (n, self.prompt_len), generator=generator)
        return self.others[idx].tolist()

    def reward(self, response: list[int]) -> float:
        """Fraction of ``response`` tokens in the target set (0 for an empty response)."""
        return target_fraction(response, self.targets)

    @property
    def chance(self) -> float:
        """Expected reward of a uniform sampler."""
        return len(self.targets) / (self.vocab_size - 3)
