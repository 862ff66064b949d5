"""Custom losses with miles' signature ``(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``.

Select with ``--loss-type custom_loss --custom-loss-function-path kimi_rl_glue.miles.losses.<name>``
(miles' ``LossFunction`` protocol in ``miles/backends/training_utils/loss_hub/losses.py``: ``logits``
is float32 ``[1, T, V]`` (thd); ``sum_of_sample_mean`` reduces a flat per-token tensor over the
response tokens, sample-mean weighted by ``loss_masks``; metrics are detached 0-d tensors).

Settings are read from ``args`` with defaults, so they can come from miles' own flags or from a
``--custom-config-path`` YAML (its keys are set on ``args``):

- ``score_centering_loss``: ``score_centering_is`` (none|tis|mis), ``score_centering_tis_clip`` (2),
  ``score_centering_mis_low`` (0.5), ``score_centering_mis_high`` (5); needs the batch keys
  ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (``--rollout-top-logprobs-num``) and
  ``rollout_log_probs``.
- ``dapo_loss``: ``eps_clip`` (0.2), ``eps_clip_high`` (= eps_clip), ``eps_clip_c`` (None = no
  dual clip), ``use_rollout_logprobs``, and SkyRL-style TIS ``tis_ratio_type`` (None|token|sequence),
  ``token_tis_ratio_clip_high`` (2), ``sequence_tis_ratio_clip_high`` (5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kimi_core.errors import KimiError
from kimi_rl_glue.losses.kl import kl_estimate
from kimi_rl_glue.losses.policy import clipped_pg_token_loss
from kimi_rl_glue.losses.score_centering import score_centering_loss as score_centering_per_token
from kimi_rl_glue.losses.tis import apply_tis
from kimi_rl_glue.miles.responses import (
    ShardLayout,
    cat_field,
    current_layout,
    iter_local_responses,
    iter_response_logits,
    pad_ragged,
    unpad,
)
from kimi_rl_glue.miles.vocab_parallel import log_probs_at

__all__ = ["MissingRolloutField", "score_centering_loss", "score_centering_loss_sharded", "dapo_loss"]


def _active(batch: dict, device) -> torch.Tensor:
    return cat_field(batch, "loss_masks", device=device).bool()


def _where(active: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(active, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), torch.zeros_like(x))


def _mismatch(
    train_lp: torch.Tensor,
    rollout_lp: torch.Tensor,
    active: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    dt = torch.float64 if train_lp.dtype == torch.float64 else torch.float32
    train_lp, rollout_lp = train_lp.detach().to(dt), rollout_lp.detach().to(dt)
    return {
        "train_rollout_logprob_abs_diff": reduce(_where(active, (train_lp - rollout_lp).abs())).detach(),
        "train_rollout_kl": reduce(_where(active, kl_estimate(rollout_lp, train_lp, "low_var_kl"))).detach(),
    }


class MissingRolloutField(KimiError, KeyError):
    """The miles batch lacks a per-token field a loss needs; the message names it and where it comes from.

    A ``KeyError`` too, for callers that catch the bare lookup error."""

    def __str__(self) -> str:  # KeyError would print the message as a quoted repr
        return str(self.args[0]) if self.args else super().__str__()


# Where each field score centering reads is produced in miles' rollout.
_TOPK_SOURCE = (
    "--rollout-top-logprobs-num K (the sampler's top-K per generated token; on radixark/miles#1792 with "
    "--custom-generate-function-path kimi_rl_glue.miles.topk_rollout.generate and "
    "--custom-convert-samples-to-train-data-path kimi_rl_glue.miles.topk_transport.convert_samples_to_train_data)"
)
_ROLLOUT_FIELD_SOURCE = {
    "rollout_topk_token_ids": _TOPK_SOURCE,
    "rollout_topk_log_probs": _TOPK_SOURCE,
    "rollout_log_probs": "--use-rollout-logprobs",
    "advantages": "an --advantage-estimator (grpo)",
}


def _require_rollout_fields(batch: dict) -> None:
    for key, source in _ROLLOUT_FIELD_SOURCE.items():
        if batch.get(key) is None:
            raise MissingRolloutField(
                f"kimi_rl_glue.miles.losses.score_centering_loss needs batch[{key!r}], which miles fills from "
                f"{source}; run miles with --rollout-top-logprobs-num K and --use-rollout-logprobs (docs/miles.md)"
            )


def score_centering_loss(
    args, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]
):
    """Score centering (``kimi_rl_glue.losses.score_centering``) as a miles custom loss.

    Works on miles' sharded logits: the vocabulary split over tensor parallelism and the tokens split
    over context parallelism, as :func:`kimi_rl_glue.miles.responses.current_layout` reads them from
    miles' parallel state (see :func:`score_centering_loss_sharded`).
    """
    return score_centering_loss_sharded(args, batch, logits, sum_of_sample_mean, current_layout(args))


def score_centering_loss_sharded(
    args,
    batch: dict,
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
    layout: ShardLayout,
):
    """:func:`score_centering_loss` for an explicit :class:`~kimi_rl_glue.miles.responses.ShardLayout`.

    :param logits: ``[1, T_local, V / tp]`` (thd) or ``[B, S_local, V / tp]`` (bshd), float32 or float64.
    :param sum_of_sample_mean: miles' reducer for this rank: it takes the flat per-token values of the
        local response tokens (in :func:`~kimi_rl_glue.miles.responses.iter_local_responses` order).
    Batch keys: ``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``,
    ``advantages``, ``rollout_log_probs`` (``[resp]`` each) and ``rollout_topk_token_ids`` /
    ``rollout_topk_log_probs`` (``[resp, K]`` each, padding id -1 / log-prob -inf); under CP each may instead
    hold this rank's rows in miles' zigzag order (``[C_i]`` / ``[C_i, K]``: what miles' ``get_rollout_data`` and
    advantage step leave, and what :mod:`kimi_rl_glue.miles.topk_transport` slices the top-K to).
    Metrics: ``loss``, ``pg_loss``, the ``sc_*`` metrics, ``train_rollout_logprob_abs_diff``,
    ``train_rollout_kl``.

    Tensor parallelism: log-probs come from :func:`kimi_rl_glue.miles.vocab_parallel.log_probs_at`
    (all-reduces over the TP group; every TP rank returns the same loss). Context parallelism: every
    quantity is per token, so each CP rank computes its own tokens' terms with no communication; the
    sums across CP ranks are miles' (``sum_of_sample_mean`` divides by whole-sample token counts and the
    gradient all-reduce adds the ranks' parts).
    """
    _require_rollout_fields(batch)
    dev = logits.device
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    chunks, ids, rollout_lp, head, adv, active = [], [], [], [], [], []
    for i, (chunk, tokens, rows) in enumerate(iter_local_responses(args, batch, logits, layout)):
        sample_ids = torch.as_tensor(batch["rollout_topk_token_ids"][i]).to(dev).long()
        resp = int(batch["response_lengths"][i])
        if sample_ids.dim() != 2 or sample_ids.shape[0] not in (resp, rows.numel()):
            raise ValueError(
                f"sample {i}: rollout_topk_token_ids has shape {tuple(sample_ids.shape)}, expected [{resp}, K] "
                f"(one row of candidates per response token) or this CP rank's [{rows.numel()}, K]"
            )

        def local(key, value):
            return _local_rows(key, i, value, rows, resp, layout)

        chunks.append(chunk)
        ids.append(torch.cat([tokens[:, None], local("rollout_topk_token_ids", sample_ids)], dim=1))
        head.append(local("rollout_topk_log_probs", torch.as_tensor(batch["rollout_topk_log_probs"][i]).to(dev, dt)))
        rollout_lp.append(local("rollout_log_probs", torch.as_tensor(batch["rollout_log_probs"][i]).to(dev, dt)))
        adv.append(local("advantages", torch.as_tensor(batch["advantages"][i]).to(dev, dt)))
        active.append(local("loss_masks", torch.as_tensor(batch["loss_masks"][i]).to(dev)).bool())
    n_local = sum(c.shape[0] for c in chunks)
    if n_local == 0:  # no response token on this rank: keep the graph connected, report nothing
        zero = 0 * logits.sum()
        return zero, {"loss": zero.detach(), "pg_loss": zero.detach()}
    all_ids = torch.cat(ids)
    if (all_ids[:, 0] < 0).any():
        raise ValueError("unconcat_tokens holds negative token ids in a response")
    lp_all = log_probs_at(
        torch.cat(chunks), all_ids, group=layout.tp_group, tp_rank=layout.tp_rank, tp_size=layout.tp_size
    )
    lp, topk_ids = lp_all[:, 0], all_ids[:, 1:]
    loss, per_token = score_centering_per_token(
        lp,
        lp_all[:, 1:],
        torch.cat(rollout_lp),
        torch.cat(head),
        torch.cat(adv),
        head_mask=topk_ids >= 0,
        importance=getattr(args, "score_centering_is", "none") or "none",
        tis_clip=float(getattr(args, "score_centering_tis_clip", 2.0)),
        mis_low=float(getattr(args, "score_centering_mis_low", 0.5)),
        mis_high=float(getattr(args, "score_centering_mis_high", 5.0)),
    )
    act = torch.cat(active)
    pg_loss = sum_of_sample_mean(_where(act, loss))
    metrics = {k: sum_of_sample_mean(_where(act, v.to(dt))).detach() for k, v in per_token.items()}
    metrics.update(_mismatch(lp, torch.cat(rollout_lp), act, sum_of_sample_mean))
    metrics.update(loss=pg_loss.detach(), pg_loss=pg_loss.detach())
    return pg_loss, metrics


def _local_rows(key: str, i: int, value: torch.Tensor, rows: torch.Tensor, resp: int, layout: ShardLayout):
    """This rank's rows of sample ``i``'s per-token ``value``: a full ``[resp, *]`` field is indexed with ``rows``;
    a field of ``rows.numel()`` rows is already this CP rank's slice in miles' zigzag order (what miles hands the
    loss for ``rollout_log_probs`` and the advantages under CP, and ``topk_transport`` for the top-K fields), the
    order of ``rows``. Both agree where the rank holds the whole response."""
    n = rows.numel()
    if value.shape[0] == resp:
        return value[rows]
    if value.shape[0] == n and layout.cp_size > 1:
        if layout.allgather_cp:
            raise ValueError(
                f"sample {i}: {key} has this CP rank's {n} rows (miles' zigzag slice) but --allgather-cp lays the "
                "logits out contiguously; score centering reads CP-sliced fields only in the zigzag layout "
                "(drop --allgather-cp)"
            )
        return value
    raise ValueError(
        f"sample {i}: {key} has {value.shape[0]} rows; expected the response's {resp} or this CP rank's {n}"
    )


def _log_probs(args, batch: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Current log-probs of the response tokens (flat, with grad) and the loss-mask flags (flat bool)."""
    try:
        from miles.backends.training_utils.cp_utils import get_local_response_loss_masks
        from miles.backends.training_utils.loss_hub.logit_processors import get_log_probs_and_entropy
    except ImportError:
        get_log_probs_and_entropy = None
    if get_log_probs_and_entropy is not None:
        # miles' own helper handles vocab-parallel logits and context parallelism.
        out = get_log_probs_and_entropy(
            logits,
            args=args,
            unconcat_tokens=batch["unconcat_tokens"],
            total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"],
            max_seq_lens=batch.get("max_seq_lens"),
        )
        masks = get_local_response_loss_masks(
            batch["total_lengths"],
            batch["response_lengths"],
            batch["loss_masks"],
            args.qkv_format,
            batch.get("max_seq_lens"),
        )
        return torch.cat(out["log_probs"]), torch.cat(masks).to(logits.device).bool()
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lps = [
        torch.log_softmax(c.to(dt), -1).gather(-1, t[:, None]).squeeze(-1)
        for c, t in iter_response_logits(args, batch, logits)
    ]
    return (torch.cat(lps) if lps else logits.new_zeros(0)), _active(batch, logits.device)


def dapo_loss(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]):
    """GRPO/DAPO clipped loss (clip-higher, dual-clip) with SkyRL-style TIS, as a miles custom loss.

    Batch keys: ``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``,
    ``advantages``; ``log_probs`` (trainer recompute) unless ``use_rollout_logprobs``;
    ``rollout_log_probs`` for TIS and the mismatch metrics.
    Metrics: ``loss``, ``pg_loss``, ``pg_clipfrac``, ``dual_clipfrac``, ``ppo_kl``, TIS metrics,
    ``train_rollout_logprob_abs_diff`` / ``train_rollout_kl`` when rollout log-probs are present.
    """
    if getattr(args, "use_tis", False) and getattr(args, "tis_ratio_type", None) is None:
        raise ValueError(
            "--use-tis is miles' built-in TIS and is not read by kimi_rl_glue.miles.losses.dapo_loss; "
            "set tis_ratio_type: token|sequence (and token_tis_ratio_clip_high / "
            "sequence_tis_ratio_clip_high) in --custom-config-path instead"
        )
    dev = logits.device
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_probs, active = _log_probs(args, batch, logits)
    rollout = (
        cat_field(batch, "rollout_log_probs", device=dev, dtype=dt)
        if batch.get("rollout_log_probs") is not None
        else None
    )
    if getattr(args, "use_rollout_logprobs", False):
        if rollout is None:
            raise KeyError("--use-rollout-logprobs is set but the batch has no 'rollout_log_probs'")
        old = rollout
    else:
        old = cat_field(batch, "log_probs", device=dev, dtype=dt)
    trainer_scored = (
        cat_field(batch, "log_probs", device=dev, dtype=dt)
        if batch.get("log_probs") is not None
        else log_probs.detach().to(dt)
    )
    adv = cat_field(batch, "advantages", device=dev, dtype=dt)
    for name, t in (("log_probs", old), ("advantages", adv), ("loss_masks", active)):
        if t.shape != log_probs.shape:
            raise ValueError(f"batch[{name!r}] holds {t.shape[0]} tokens, the responses hold {log_probs.shape[0]}")
    eps = float(getattr(args, "eps_clip", 0.2))
    eps_high = getattr(args, "eps_clip_high", None)
    c = getattr(args, "eps_clip_c", None)
    loss, clipped, dual = clipped_pg_token_loss(
        log_probs,
        old,
        _where(active, adv),
        eps_low=eps,
        eps_high=eps if eps_high is None else float(eps_high),
        clip_ratio_c=None if c is None else float(c),
    )
    tis_type = getattr(args, "tis_ratio_type", None)
    metrics: dict[str, torch.Tensor] = {}
    if tis_type is not None:
        if rollout is None:
            raise KeyError(f"tis_ratio_type={tis_type!r} needs batch['rollout_log_probs']")
        # TIS is per sequence for "sequence": work on the padded [B, R] view of the local tokens.
        lengths = [int(x.shape[0]) for x in batch["advantages"]]
        pl, pm = pad_ragged(loss, lengths)
        po, _ = pad_ragged(trainer_scored, lengths)
        pr, _ = pad_ragged(rollout, lengths)
        pa, _ = pad_ragged(active.float(), lengths)
        pl, tis_m = apply_tis(
            pl,
            po,
            pr,
            pa,
            tis_type,
            token_cap=float(getattr(args, "token_tis_ratio_clip_high", 2.0)),
            sequence_cap=float(getattr(args, "sequence_tis_ratio_clip_high", 5.0)),
        )
        loss = unpad(pl, pm)
        metrics.update({k: torch.tensor(v) for k, v in tis_m.items()})
    pg_loss = sum_of_sample_mean(_where(active, loss))
    if log_probs.numel() == 0:
        pg_loss = pg_loss + 0 * logits.sum()
    metrics.update(
        loss=pg_loss.detach(),
        pg_loss=pg_loss.detach(),
        pg_clipfrac=sum_of_sample_mean(_where(active, clipped.float())).detach(),
        dual_clipfrac=sum_of_sample_mean(_where(active, dual.float())).detach(),
        ppo_kl=sum_of_sample_mean(_where(active, (old - log_probs.detach()).to(dt))).detach(),
    )
    if rollout is not None:
        metrics.update(_mismatch(trainer_scored, rollout, active, sum_of_sample_mean))
    return pg_loss, metrics
