"""The sampler's top-K per generated token, produced in miles' rollout for score centering.

``kimi_rl_glue.miles.losses.score_centering_loss`` reads, per sample, ``rollout_topk_token_ids``
``[resp, K]`` (int64, padding id -1) and ``rollout_topk_log_probs`` ``[resp, K]`` (float32, padding
-inf): the K most likely next tokens of the sampling distribution at each response position and
their log-probabilities. No miles rollout of the native-LoRA branch (radixark/miles#1792) records
them; this module does, through miles' own extension point for the per-sample generate call:

    --custom-generate-function-path kimi_rl_glue.miles.topk_rollout.generate
    --rollout-top-logprobs-num K

miles' parser calls ``generate.add_arguments(parser)`` while it parses
(``miles/utils/arguments.py``, ``add_user_provided_function_arguments``), which defines
``--rollout-top-logprobs-num`` when that miles does not define it itself. :func:`generate` is
miles' single-turn generate (``miles/rollout/generate_hub/single_turn.py``: the same prompt ids,
payload, routing headers and sample update, all miles' own helpers) plus ``top_logprobs_num = K``
in the request to SGLang's ``/generate``; the answer's ``meta_info["output_top_logprobs"]`` (one
row per generated token, each a list of ``[logprob, token_id, text]``, most likely first; SGLang
``TokenizerManager.detokenize_top_logprobs_tokens``) becomes the two fields above, appended on a
partial-rollout resume like ``rollout_log_probs``.

SGLang's log-probs are those of the distribution it samples from (``log_softmax(logits / T)`` with
top-p 1 and no ``SGLANG_RETURN_ORIGINAL_LOGPROB``), the one the trainer recomputes from
``logits / --rollout-temperature``.

Carrying the fields from the rollout samples into the train batch is miles' conversion
(``miles/ray/rollout/train_data_conversion.py``) and the train step's ``get_batch`` key list
(``miles/backends/megatron_utils/model.py``); at radixark/miles#1792 both name a fixed set of keys
without these two (docs/miles.md).
"""

from __future__ import annotations

import logging
import math

from kimi_core.errors import KimiError

__all__ = [
    "TOPK_FLAG",
    "TOPK_IDS",
    "TOPK_LOG_PROBS",
    "PAD_ID",
    "MissingTopLogprobs",
    "add_arguments",
    "register_kimi_configs",
    "top_k_of",
    "request_top_logprobs",
    "topk_rows",
    "append_topk",
    "generate",
]

TOPK_FLAG = "--rollout-top-logprobs-num"
TOPK_IDS = "rollout_topk_token_ids"
TOPK_LOG_PROBS = "rollout_topk_log_probs"
PAD_ID = -1
_WHERE = "kimi_rl_glue.miles.topk_rollout"
log = logging.getLogger(__name__)


class MissingTopLogprobs(KimiError, ValueError):
    """SGLang's answer lacks the top-K log-probs this rollout asked for, or K is not set; names the field."""


def add_arguments(parser):
    """Define ``--rollout-top-logprobs-num K`` on miles' parser unless this miles already has it.

    miles calls this in its driver before it reads ``--hf-checkpoint``'s config with ``AutoConfig``
    (``miles/utils/hf_config.py``), so it also registers ``model_type: kimi_k31``, which stock SGLang
    does not know (:func:`register_kimi_configs`)."""
    register_kimi_configs()
    if TOPK_FLAG not in parser._option_string_actions:
        parser.add_argument(
            TOPK_FLAG,
            type=int,
            default=0,
            help=f"K of the sampler's top-K log-probs per generated token ({_WHERE}): score centering's candidate set",
        )
    return parser


def register_kimi_configs() -> bool:
    """Register K3.1's HF config with ``AutoConfig`` (``kimi_sglang_plugin``'s, on SGLang's K3 config) in this
    process; False, with a log line, where SGLang or the plugin is absent. Never raises into miles' parser."""
    try:
        from kimi_sglang_plugin.registration import register_config

        register_config()
    except Exception as e:  # noqa: BLE001 - a plugin never raises out of its host's loader
        log.warning("%s: K3.1 config not registered with AutoConfig (%s: %s)", _WHERE, type(e).__name__, e)
        return False
    return True


def top_k_of(args) -> int:
    """``args.rollout_top_logprobs_num`` as a positive int; :class:`MissingTopLogprobs` otherwise."""
    k = getattr(args, "rollout_top_logprobs_num", None)
    if not isinstance(k, int) or k <= 0:
        raise MissingTopLogprobs(
            f"{_WHERE}.generate needs {TOPK_FLAG} K > 0 (got {k!r}); pass it beside "
            f"--custom-generate-function-path {_WHERE}.generate"
        )
    return k


def request_top_logprobs(payload: dict, k: int) -> dict:
    """``payload`` (SGLang ``/generate`` JSON) asking for log-probs and the top-``k`` per generated token.

    ``top_logprobs_num`` is a request field of SGLang's ``GenerateReqInput``, not a sampling parameter."""
    return {**payload, "return_logprob": True, "top_logprobs_num": int(k)}


def topk_rows(meta_info: dict, tokens: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """``(ids [n, k], log-probs [n, k])`` from SGLang's ``meta_info`` for the ``n = len(tokens)`` new tokens.

    A row with fewer than ``k`` candidates (a vocabulary smaller than ``k``) is padded with id
    :data:`PAD_ID` and log-prob ``-inf``; candidates keep SGLang's order (most likely first).

    :raises MissingTopLogprobs: ``output_top_logprobs`` is absent, has another length than the new
        tokens, or a row is empty (SGLang returns ``None`` where it computed no log-probs).
    """
    rows = meta_info.get("output_top_logprobs")
    if rows is None:
        raise MissingTopLogprobs(
            f"{_WHERE}: SGLang's /generate answer has no meta_info['output_top_logprobs'] although the request "
            f"set top_logprobs_num={k}; this SGLang does not return top-K log-probs (score centering needs "
            f"batch[{TOPK_IDS!r}] / batch[{TOPK_LOG_PROBS!r}])"
        )
    if len(rows) != len(tokens):
        raise MissingTopLogprobs(
            f"{_WHERE}: meta_info['output_top_logprobs'] has {len(rows)} rows for {len(tokens)} generated tokens "
            "(meta_info['output_token_logprobs']); one row per generated token is needed"
        )
    ids, lps = [], []
    for pos, row in enumerate(rows):
        if not row:
            raise MissingTopLogprobs(
                f"{_WHERE}: meta_info['output_top_logprobs'][{pos}] is {row!r}: SGLang returned no top-K "
                f"log-probs for generated token {pos}"
            )
        row = list(row)[:k]
        ids.append([int(entry[1]) for entry in row] + [PAD_ID] * (k - len(row)))
        lps.append([float(entry[0]) for entry in row] + [-math.inf] * (k - len(row)))
    return ids, lps


def append_topk(sample, ids: list[list[int]], lps: list[list[float]]) -> None:
    """Append rows to ``sample.rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (created when absent)."""
    setattr(sample, TOPK_IDS, list(getattr(sample, TOPK_IDS, None) or []) + ids)
    setattr(sample, TOPK_LOG_PROBS, list(getattr(sample, TOPK_LOG_PROBS, None) or []) + lps)


async def generate(input):
    """miles' ``--custom-generate-function-path``: single-turn generate that also records the top-K.

    :param input: miles' ``GenerateFnInput`` (``state``, ``sample``, ``sampling_params``, ``evaluation``).
    :returns: miles' ``GenerateFnOutput(samples=sample)``; the sample gains ``[n, K]`` rows of
        :data:`TOPK_IDS` / :data:`TOPK_LOG_PROBS` for its ``n`` new tokens.
    """
    from miles.rollout.base_types import GenerateFnOutput
    from miles.rollout.generate_utils.generate_endpoint_utils import (
        compute_prompt_ids_from_sample,
        compute_request_payload,
        compute_routing_headers,
        update_sample_from_response,
    )
    from miles.utils.http_utils import post
    from miles.utils.types import Sample

    args, sample, sampling_params = input.args, input.sample, input.sampling_params
    k = top_k_of(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"{_WHERE}.generate: sample {sample.index} has status {sample.status}; expected pending")
    prompt_ids = compute_prompt_ids_from_sample(input.state, sample)
    input_ids = prompt_ids
    if sample.response:  # partial rollout: continue from the tokens so far, within the same budget
        input_ids = sample.tokens
        sampling_params["max_new_tokens"] -= len(sample.tokens) - len(prompt_ids)
        if sampling_params["max_new_tokens"] <= 0:
            sample.status = Sample.Status.TRUNCATED
            return GenerateFnOutput(samples=sample)
    payload, halt = compute_request_payload(
        args, input_ids=input_ids, sampling_params=sampling_params, multimodal_inputs=sample.multimodal_inputs
    )
    if payload is None:
        sample.status = halt
        return GenerateFnOutput(samples=sample)
    payload = request_top_logprobs(payload, k)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, payload, headers=compute_routing_headers(args, sample))
    new_tokens = [int(t[1]) for t in output["meta_info"].get("output_token_logprobs") or []]
    ids, lps = topk_rows(output["meta_info"], new_tokens, k)
    await update_sample_from_response(args, sample, payload=payload, output=output)
    append_topk(sample, ids, lps)
    return GenerateFnOutput(samples=sample)


generate.add_arguments = add_arguments  # miles' parser calls it (add_user_provided_function_arguments)
