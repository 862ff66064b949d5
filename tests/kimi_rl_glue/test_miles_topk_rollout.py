"""kimi_rl_glue.miles.topk_rollout without miles: SGLang's ``output_top_logprobs`` rows into ``[n, K]`` fields, the
request it sends, the flag it adds to a parser, and its errors. (Inside miles' own rollout step, against a fake
SGLang built from float64 logits: tests/py312/test_miles_topk_rollout.py.)"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
import torch

from kimi_rl_glue.miles import topk_rollout as tr


def _sglang_rows(lp: torch.Tensor, k: int) -> list:
    """SGLang 0.5.17's ``meta_info['output_top_logprobs']`` for log-probs ``lp [n, V]``: per token the ``k`` most
    likely ``[logprob, id, None]``, most likely first (JSON lists)."""
    vals, ids = lp.topk(k, dim=-1)
    return [[[v, i, None] for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), ids.tolist())]


def test_rows_equal_float64_topk():
    """[n, K] ids (int) and log-probs equal log_softmax(logits / T).topk(K) in float64, row for row."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 50, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(logits / 0.7, dim=-1)
    ids, lps = tr.topk_rows({"output_top_logprobs": _sglang_rows(lp, 8)}, list(range(6)), 8)
    want_lp, want_ids = lp.topk(8, dim=-1)
    assert torch.equal(torch.tensor(ids), want_ids)
    assert torch.equal(torch.tensor(lps, dtype=torch.float64), want_lp)


def test_short_rows_are_padded_and_long_rows_cut():
    ids, lps = tr.topk_rows({"output_top_logprobs": [[[-0.1, 3, "a"], [-2.0, 9, "b"]]]}, [3], 3)
    assert ids == [[3, 9, tr.PAD_ID]] and lps[0][:2] == [-0.1, -2.0] and lps[0][2] == -math.inf
    ids, _ = tr.topk_rows({"output_top_logprobs": [[[-0.1, 3, None], [-2.0, 9, None]]]}, [3], 1)
    assert ids == [[3]]


@pytest.mark.parametrize(
    "meta, match",
    [
        ({}, "has no meta_info\\['output_top_logprobs'\\]"),
        ({"output_top_logprobs": [[[-0.1, 3, None]]]}, "1 rows for 2 generated tokens"),
        ({"output_top_logprobs": [[[-0.1, 3, None]], None]}, "output_top_logprobs'\\]\\[1\\] is None"),
    ],
)
def test_missing_top_logprobs_are_named(meta, match):
    with pytest.raises(tr.MissingTopLogprobs, match=match):
        tr.topk_rows(meta, [3, 4], 2)


def test_request_and_k():
    payload = tr.request_top_logprobs({"input_ids": [1], "sampling_params": {"temperature": 1.0}}, 16)
    assert payload["top_logprobs_num"] == 16 and payload["return_logprob"] is True
    assert "top_logprobs_num" not in payload["sampling_params"]
    assert tr.top_k_of(SimpleNamespace(rollout_top_logprobs_num=16)) == 16
    with pytest.raises(tr.MissingTopLogprobs, match="--rollout-top-logprobs-num"):
        tr.top_k_of(SimpleNamespace(rollout_top_logprobs_num=0))


def test_add_arguments_defines_the_flag_once():
    """miles calls generate.add_arguments on its parser; a parser that already has the flag keeps its own."""
    assert tr.generate.add_arguments is tr.add_arguments
    p = tr.add_arguments(argparse.ArgumentParser())
    assert p.parse_args(["--rollout-top-logprobs-num", "128"]).rollout_top_logprobs_num == 128
    own = argparse.ArgumentParser()
    own.add_argument("--rollout-top-logprobs-num", type=int, default=7)
    assert tr.add_arguments(own).parse_args([]).rollout_top_logprobs_num == 7


def test_append_topk_extends_a_partial_rollout():
    s = SimpleNamespace()
    tr.append_topk(s, [[1, 2]], [[-0.1, -0.2]])
    tr.append_topk(s, [[3, -1]], [[-0.3, -math.inf]])
    assert s.rollout_topk_token_ids == [[1, 2], [3, -1]] and len(s.rollout_topk_log_probs) == 2


def test_transport_refusals_without_miles():
    """topk_transport: the dynamic global batch size (which needs the rollout metadata miles withholds from
    custom conversions) is refused by name; without miles' Megatron backend the train side installs nothing."""
    from kimi_rl_glue.miles import topk_transport

    with pytest.raises(topk_transport.TopkTransportError, match="--use-dynamic-global-batch-size"):
        topk_transport.convert_samples_to_train_data(SimpleNamespace(use_dynamic_global_batch_size=True), [])
    assert topk_transport.install_train_side() is False
    assert [p.target.rsplit(".", 1)[1] for p in topk_transport.PATCHES] == ["_package_shards", "get_batch"]
