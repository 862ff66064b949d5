"""RL losses on plain tensors, one concept per file; hosts register them (``kimi_rl_glue.miles``,
``kimi_rl_glue.skyrl``). Shapes and dtypes are in each function's docstring; ``docs/losses.md``
has the equations and the host flags.

| file | concept |
| --- | --- |
| ``score_centering.py`` | score centering (miles.md section 6): top-K head, tail ratio rho, alpha, none/tis/mis |
| ``policy.py`` | GRPO/DAPO clipped PG loss: clip-higher, dual-clip, reductions, TIS hook |
| ``tis.py`` | truncated importance sampling, token and sequence caps (SkyRL semantics) |
| ``advantages.py`` | group-mean / group-std (GRPO) advantages, SkyRL and miles conventions |
| ``overlong.py`` | DAPO soft overlong punishment |
| ``dynamic_sampling.py`` | DAPO dynamic-sampling group filter |
| ``kl.py`` | k1/k2/k3/low_var_kl estimators, train/rollout KL and logprob abs diff |
| ``reduction.py`` | token_mean / sequence_mean / sum |
"""

from kimi_rl_glue.losses.advantages import group_advantages, group_ids_from_size
from kimi_rl_glue.losses.dynamic_sampling import dynamic_sampling_keep, keep_group
from kimi_rl_glue.losses.kl import kl_estimate, mismatch_metrics, train_rollout_kl, train_rollout_logprob_abs_diff
from kimi_rl_glue.losses.overlong import apply_overlong_penalty, overlong_penalty
from kimi_rl_glue.losses.policy import clipped_pg_token_loss, policy_loss
from kimi_rl_glue.losses.reduction import masked_mean, reduce_tokens
from kimi_rl_glue.losses.score_centering import importance_weight, score_centering_from_logits, score_centering_loss
from kimi_rl_glue.losses.tis import apply_tis, tis_weights

__all__ = [
    "apply_overlong_penalty",
    "apply_tis",
    "clipped_pg_token_loss",
    "dynamic_sampling_keep",
    "group_advantages",
    "group_ids_from_size",
    "importance_weight",
    "keep_group",
    "kl_estimate",
    "masked_mean",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "reduce_tokens",
    "score_centering_from_logits",
    "score_centering_loss",
    "tis_weights",
    "train_rollout_kl",
    "train_rollout_logprob_abs_diff",
]
