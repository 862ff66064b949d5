"""Policy losses with SkyRL's signature
``(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None) -> (loss, metrics)``.

Registered by :func:`kimi_rl_glue.skyrl.registry.register_skyrl_losses`; select with
``trainer.algorithm.policy_loss_type=kimi_dapo`` (clip-higher + dual-clip + TIS) or ``kimi_grpo``
(clip-higher + TIS, no dual-clip). They read ``config`` = ``trainer.algorithm``:
``eps_clip_low``, ``eps_clip_high``, ``clip_ratio_c`` and ``off_policy_correction.{tis_ratio_type,
token_tis_ratio_clip_high, sequence_tis_ratio_clip_high}``.

Reduction: SkyRL (``skyrl-v0.3.0`` and later) applies ``trainer.algorithm.loss_reduction`` by
rescaling the advantages before the loss (``apply_loss_reduction_to_advantages_minibatch``), and its
own losses return the masked **sum**; these do the same. Metrics are Python floats as SkyRL's.
Score centering is not offered here: SkyRL's loss signature carries only sampled-token log-probs,
and score centering needs the trainer's log-probs at the sampler's top-K candidates.
"""

from __future__ import annotations

import torch

from kimi_rl_glue.losses.policy import policy_loss

__all__ = ["kimi_dapo_policy_loss", "kimi_grpo_policy_loss", "UNSUPPORTED_CORRECTIONS"]

# off_policy_correction keys whose features are SkyRL's own (masks), not implemented by these losses.
UNSUPPORTED_CORRECTIONS = (
    "sequence_mask_metric",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _loss(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs, dual_clip: bool, name: str):
    opc = _get(config, "off_policy_correction")
    for key in UNSUPPORTED_CORRECTIONS:
        if _get(opc, key) is not None:
            raise ValueError(
                f"trainer.algorithm.off_policy_correction.{key} is set but policy_loss_type={name} "
                "implements only TIS (tis_ratio_type); unset it or use a built-in SkyRL loss"
            )
    if _get(config, "use_tis", False):
        raise ValueError(
            f"trainer.algorithm.use_tis is deprecated in SkyRL and not read by {name}; set "
            "trainer.algorithm.off_policy_correction.tis_ratio_type=token instead"
        )
    c = _get(config, "clip_ratio_c", 3.0) if dual_clip else None
    loss, metrics = policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        loss_mask,
        rollout_logprobs,
        eps_low=float(_get(config, "eps_clip_low", 0.2)),
        eps_high=float(_get(config, "eps_clip_high", 0.2)),
        clip_ratio_c=None if c is None else float(c),
        reduction="sum",
        tis_type=_get(opc, "tis_ratio_type"),
        token_tis_cap=float(_get(opc, "token_tis_ratio_clip_high", 2.0)),
        sequence_tis_cap=float(_get(opc, "sequence_tis_ratio_clip_high", 5.0)),
    )
    return loss, metrics


def kimi_dapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config,
    loss_mask: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
):
    """DAPO: clip-higher ``[1 - eps_clip_low, 1 + eps_clip_high]``, dual-clip ``clip_ratio_c``, TIS.

    :param log_probs, old_log_probs, advantages, loss_mask, rollout_logprobs: ``[B, T]``.
    :returns: ``(masked-sum loss 0-d float32, {clip_ratio, dual_clip_ratio, ppo_kl, tis...: float})``.
    """
    return _loss(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs, True, "kimi_dapo")


def kimi_grpo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config,
    loss_mask: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
):
    """GRPO with clip-higher and TIS, without dual-clip (same contract as :func:`kimi_dapo_policy_loss`)."""
    return _loss(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs, False, "kimi_grpo")
