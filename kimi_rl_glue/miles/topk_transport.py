"""Carry the rollout's top-K fields from miles' samples into the train batch the loss reads (miles PR #1792).

:mod:`kimi_rl_glue.miles.topk_rollout` leaves ``rollout_topk_token_ids`` / ``rollout_topk_log_probs``
(``[resp, K]``) on each ``Sample``. At radixark/miles#1792 three fixed lists stand between them and
``score_centering_loss``; this module extends two of them, each a ledgered patch (:data:`PATCHES`):

1. rollout side, ``--custom-convert-samples-to-train-data-path
   kimi_rl_glue.miles.topk_transport.convert_samples_to_train_data``: miles' own conversion
   (``miles/ray/rollout/train_data_conversion.py``, called here) plus the two fields as int32 / float32
   ``[resp, K]`` arrays; and miles' ``_package_shards`` (the per-DP-rank split, which copies a fixed key
   list) wrapped to copy them too;
2. train side, :func:`install_train_side` (run by ``kimi_rl_glue.miles.init``): the ``get_batch`` that
   ``miles/backends/megatron_utils/model.py`` calls with a fixed key list asks also for the two fields
   when the rollout data has them.

Context parallelism: miles hands the train step ``rollout_log_probs`` (``get_rollout_data``) and the
advantages it computes from them as this CP rank's response rows (``slice_log_prob_with_cp`` in
``miles/backends/training_utils/cp_utils.py``: the zigzag chunks ``r`` and ``2 cp - 1 - r``, in that order,
also under ``--allgather-cp``). The wrapped ``get_batch`` slices the two top-K fields with that same function,
so every per-token field the loss reads has this rank's ``[C_i]`` rows (``[C_i, K]``) in one order. Ray's object store (miles' default) carries any
key; the Mooncake store's typed field schemas do not know these two.

The custom conversion replaces miles' call, which also passes the rollout metadata: a run with
``--use-dynamic-global-batch-size`` (its size comes from that metadata) is refused with the flag named.
"""

from __future__ import annotations

import functools
import logging

from kimi_core.errors import KimiError
from kimi_core.patch_ledger import PatchEntry, check_patch, resolve_target
from kimi_rl_glue.miles.topk_rollout import TOPK_IDS, TOPK_LOG_PROBS

__all__ = [
    "TOPK_KEYS",
    "PATCHES",
    "TopkTransportError",
    "convert_samples_to_train_data",
    "install_rollout_side",
    "install_train_side",
    "slice_per_cp_rank",
]

log = logging.getLogger(__name__)
TOPK_KEYS = (TOPK_IDS, TOPK_LOG_PROBS)
_MARK = "_kimi_topk_transport"
_UPSTREAM = "radixark/miles#1792 (a later miles main carries rollout_topk_* itself)"
_REMOVE = "miles carries rollout_topk_* into the train batch (--rollout-top-logprobs-num in miles itself)"

PATCHES = (
    PatchEntry(
        name="miles_package_shards_topk",
        target="miles.ray.rollout.train_data_conversion._package_shards",
        host="miles",
        versions=">=0.1.0",
        why="the DP split copies a fixed list of per-sample keys and drops rollout_topk_*",
        how="wrap: after miles' split, copy rollout_topk_* rows of each shard's partition",
        upstream=_UPSTREAM,
        remove_when=_REMOVE,
        expect="signature:(args, data: dict[str, typing.Any], partitions) -> list[dict[str, typing.Any]]",
    ),
    PatchEntry(
        name="miles_train_get_batch_topk",
        target="miles.backends.megatron_utils.model.get_batch",
        host="miles",
        versions=">=0.1.0",
        why="the train step asks get_batch for a fixed key list without rollout_topk_*",
        how="wrap the name model.py calls: add rollout_topk_* to the keys when the rollout data has them, and "
        "slice them per CP rank as miles slices rollout_log_probs (slice_log_prob_with_cp)",
        upstream=_UPSTREAM,
        remove_when=_REMOVE,
        expect="reads:get_parallel_state",
    ),
)


class TopkTransportError(KimiError, ValueError):
    """The rollout samples lack the top-K fields, or the run uses a flag this conversion cannot honour."""


def _wrap(entry: PatchEntry, make) -> bool:
    """Replace ``entry.target`` by ``make(original)`` once (checked against the ledger first); False if done."""
    module_name, _, attr = entry.target.rpartition(".")
    original = resolve_target(entry.target)
    if getattr(original, _MARK, False):
        return False
    check_patch(entry, target_obj=original)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(resolve_target(module_name), attr, wrapper)
    log.info("kimi_rl_glue.miles.topk_transport: patched %s (%s)", entry.target, entry.name)
    return True


def install_rollout_side() -> bool:
    """Wrap miles' ``_package_shards`` so each DP shard gets its rows of rollout_topk_*; idempotent."""

    def make(original):
        def _package_shards(args, data, partitions):
            shards = original(args, data, partitions)
            for key in TOPK_KEYS:
                if key in data:
                    for shard in shards:
                        shard[key] = [data[key][j] for j in shard["partition"]]
            return shards

        return _package_shards

    return _wrap(PATCHES[0], make)


def install_train_side() -> bool:
    """Make miles' train step ask ``get_batch`` for rollout_topk_* when its rollout data has them; idempotent.

    A no-op (False) where miles' Megatron backend is not importable."""
    try:
        import miles.backends.megatron_utils.model  # noqa: F401
    except ImportError:
        return False

    def make(original):
        def get_batch(data_iterator, keys, *args, **kwargs):
            data = getattr(data_iterator, "rollout_data", None) or {}
            extra = [k for k in TOPK_KEYS if k in data and k not in keys]
            batch = original(data_iterator, [*keys, *extra], *args, **kwargs)
            qkv_format = kwargs.get("qkv_format", args[1] if len(args) > 1 else "thd")
            for key in extra:
                if batch.get(key) is not None:
                    batch[key] = slice_per_cp_rank(batch, batch[key], qkv_format)
            return batch

        return get_batch

    return _wrap(PATCHES[1], make)


def slice_per_cp_rank(batch: dict, rows: list, qkv_format: str) -> list:
    """This CP rank's response rows of each sample's ``[resp, K]`` array, as miles' ``get_rollout_data`` slices
    ``rollout_log_probs`` (``slice_log_prob_with_cp``, zigzag order; the rows unchanged at CP 1).

    :param batch: the micro-batch (``total_lengths``, ``response_lengths``; ``max_seq_lens`` for bshd).
    :param rows: one ``[resp, K]`` array (numpy or torch) per sample.
    :returns: one ``[C_i, K]`` tensor per sample.
    """
    import torch
    from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp

    max_lens = batch.get("max_seq_lens") if qkv_format == "bshd" else None
    return [
        slice_log_prob_with_cp(
            torch.as_tensor(value), int(total), int(resp), qkv_format, int(max_lens[i]) if max_lens else None
        )
        for i, (value, total, resp) in enumerate(
            zip(rows, batch["total_lengths"], batch["response_lengths"], strict=True)
        )
    ]


def convert_samples_to_train_data(args, samples):
    """miles' ``--custom-convert-samples-to-train-data-path``: miles' conversion plus rollout_topk_*.

    :returns: miles' train-data dict with ``rollout_topk_token_ids`` (int32) and ``rollout_topk_log_probs``
        (float32), one ``[response_length, K]`` array per sample.
    :raises TopkTransportError: ``--use-dynamic-global-batch-size`` is set, or a sample has no top-K
        rows or a row count other than its response length.
    """
    if getattr(args, "use_dynamic_global_batch_size", False):
        raise TopkTransportError(
            "kimi_rl_glue.miles.topk_transport.convert_samples_to_train_data: miles passes custom conversions no "
            "rollout metadata, which --use-dynamic-global-batch-size needs; drop that flag"
        )
    import numpy as np
    from miles.ray.rollout import train_data_conversion
    from miles.utils.misc import load_function

    install_rollout_side()
    post = getattr(args, "custom_reward_post_process_path", None)
    data = train_data_conversion.convert_samples_to_train_data(
        args, samples, {}, None, load_function(post) if post else None
    )
    for key, dtype in ((TOPK_IDS, np.int32), (TOPK_LOG_PROBS, np.float32)):
        rows = []
        for s in samples:
            value = getattr(s, key, None)
            if value is None or len(value) != s.response_length:
                raise TopkTransportError(
                    f"sample {s.index}: {key} has {None if value is None else len(value)} rows for "
                    f"{s.response_length} response tokens; the rollout must run with --custom-generate-function-path "
                    "kimi_rl_glue.miles.topk_rollout.generate"
                )
            rows.append(np.asarray(value, dtype=dtype).reshape(s.response_length, -1))
        data[key] = rows
    return data
