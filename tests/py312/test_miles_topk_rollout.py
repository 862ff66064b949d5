"""The rollout's top-K fields, produced by our ``--custom-generate-function-path`` inside miles' own rollout step.

miles (the pinned commit, on its Megatron-LM fork) parses the K3.1 script's command line, builds its
``GenerateState`` and runs ``generate_and_rm`` for one sample against a fake SGLang ``/generate`` that
answers in SGLang 0.5.17's JSON shape from seeded float64 logits (tests/py312/miles_hooks.py). The
sample's ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` must equal a float64 recomputation from
those logits (``log_softmax(logits / T)``, top K), and the reward comes from our ``--custom-rm-path``
through miles' ``async_rm``.
"""

from __future__ import annotations

import pytest
import torch
from miles_lane import missing_sources, run_check, script_command, tiny_checkpoint
from py312_lane import require

require("torch", "torch")
if (why := missing_sources()) is not None:
    pytest.skip(f"miles sources: {why}", allow_module_level=True)

K31 = "examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh"
SMOKE = dict(NUM_NODES="1", GPUS_PER_NODE="8", TP="2", PP="2", CP="2", EP="4", ROLLOUT_TP="8", ROLLOUT_EP="8")
SMOKE.update(ROLLOUT_ATTN_DP="1", GLOBAL_BATCH_SIZE="32", ROLLOUT_BATCH_SIZE="2", TOP_LOGPROBS_NUM="16")
N_NEW, TEMPERATURE = 5, 0.7


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """One miles rollout step against an SGLang that returns the top-K and one against an SGLang that returns
    none (one child process: miles parses and builds its GenerateState once)."""
    ckpt = tiny_checkpoint("k31", tmp_path_factory.mktemp("k31"))
    argv, env = script_command(K31, ckpt, SMOKE)
    answer = dict(vocab=1024, n_new=N_NEW, seed=7, text="<think> 2 + 2 </think> the answer is \\boxed{4}")
    payload = dict(
        argv=[*argv, "--rollout-temperature", str(TEMPERATURE)],
        env=env,
        prompt="what is 2 + 2 ?",
        label="4",
        servers=[answer, dict(answer, drop_top=True)],
    )
    good, dropped = run_check("topk_rollout", payload)["runs"]
    return {"good": good, "dropped": dropped}


def test_topk_fields_equal_float64_recomputation(rollouts):
    """[N_NEW, K] ids and log-probs of the sampler's top-K, equal to log_softmax(logits / T).topk(K) in float64;
    the request carried top_logprobs_num = K and return_logprob; miles' reward path scored the response."""
    out = rollouts["good"]
    assert "error" not in out, out.get("error")
    k = out["k"]
    assert k == 16 and out["temperature"] == TEMPERATURE
    (req,) = out["requests"]
    assert req["top_logprobs_num"] == k and req["return_logprob"] is True
    assert "top_logprobs_num" not in req["sampling_params"]
    logits = torch.tensor(out["logits"][0], dtype=torch.float64)  # [N_NEW, V]
    lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    want_lp, want_ids = lp.topk(k, dim=-1)
    ids = torch.tensor(out["rollout_topk_token_ids"], dtype=torch.int64)
    lps = torch.tensor(out["rollout_topk_log_probs"], dtype=torch.float64)
    assert ids.shape == lps.shape == (N_NEW, k) == (out["response_length"], k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lps, want_lp, rtol=0, atol=1e-12)
    # the sampled token's log-prob (miles' rollout_log_probs) is the same distribution's
    new_tokens = torch.tensor(out["tokens"][-N_NEW:])
    torch.testing.assert_close(
        torch.tensor(out["rollout_log_probs"], dtype=torch.float64),
        lp.gather(1, new_tokens[:, None])[:, 0],
        rtol=0,
        atol=1e-12,
    )
    assert out["reward"] == 1.0


def test_sglang_without_top_logprobs_is_named(rollouts):
    """An SGLang that answers no top-K rows stops the rollout with our error naming the SGLang field."""
    out = rollouts["dropped"]
    assert out["error"].startswith("MissingTopLogprobs")
    assert "output_top_logprobs" in out["error"] and "SGLang" in out["error"]
