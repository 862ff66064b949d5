"""DAPO's soft overlong punishment of the reward.

Facts from SkyRL (``DAPOTrainer.postprocess_generator_output``
in ``examples/train/algorithms/dapo/main_dapo.py``; DAPO paper, eq. 13). With ``L_max`` the maximum
response length and ``L_buf`` the buffer::

    |y| <= L_max - L_buf            : r unchanged
    L_max - L_buf < |y| <= L_max    : r - (|y| - (L_max - L_buf)) / L_buf * factor
    |y| > L_max                     : r := 0  (set, not subtracted)

The Kimi SkyRL recipe uses ``L_buf = 4096`` and ``factor = 1.0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["overlong_penalty", "apply_overlong_penalty"]


def _check(max_response_length: int, buffer_len: int) -> None:
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be in [1, max_generate_length={max_response_length}]")


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """The penalty subtracted inside the buffer: ``[N]`` float64, 0 outside ``(L_max - L_buf, L_max]``."""
    _check(max_response_length, buffer_len)
    n = torch.as_tensor(response_lengths).to(torch.float64)
    start = max_response_length - buffer_len
    inside = (n > start) & (n <= max_response_length)
    return torch.where(inside, (n - start) / buffer_len * penalty_factor, torch.zeros_like(n))


def apply_overlong_penalty(
    rewards: torch.Tensor | Sequence[float],
    response_lengths: torch.Tensor | Sequence[int],
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Rewards after DAPO's soft overlong punishment.

    :param rewards: ``[N]`` scalar rewards.
    :param response_lengths: ``[N]`` response lengths in tokens.
    :param max_response_length: ``L_max`` (SkyRL ``generator.sampling_params.max_generate_length``,
        miles ``--rollout-max-response-len``).
    :param buffer_len: ``L_buf`` (``overlong_buffer_len``). :param penalty_factor: ``overlong_buffer_penalty_factor``.
    :returns: ``[N]`` float64 rewards.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).clone()
    n = torch.as_tensor(response_lengths)
    if r.shape != n.shape:
        raise ValueError(f"rewards shape {tuple(r.shape)} != response_lengths shape {tuple(n.shape)}")
    r = r - overlong_penalty(n, max_response_length, buffer_len, penalty_factor)
    return torch.where(n.to(torch.float64) > max_response_length, torch.zeros_like(r), r)
