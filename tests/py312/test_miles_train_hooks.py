"""Our train-side hooks reached through miles' own code, on the pinned Megatron-LM fork, one rank (one child
process: miles parses the K3.1 script, one GPU's layout, tiny K3.1 config, once).

Loss: score centering through miles' own loss path: a micro-batch packed by miles' ``get_batch`` from a
``DataIterator`` and miles' ``loss_function`` (dispatch on ``--loss-type custom_loss
--custom-loss-function-path``, its per-token reducer and scaling), float64 logits. With the keys miles' train
step asks ``get_batch`` for, the batch has no ``rollout_topk_*`` and our loss stops naming the field
(docs/miles.md: PR #1792 carries no top-K into the train batch); with the two keys added, the loss and its
logits gradient equal the plain per-sample loss (``score_centering_from_logits``) summed per token.

Top-K transport: our ``--custom-convert-samples-to-train-data-path`` and the two ledgered wraps of
``kimi_rl_glue.miles.topk_transport`` carry the producer's fields through miles' DP split and train-step
``get_batch`` into the loss.

Context parallelism: CP 2 (two forked ranks) through miles' own per-rank slicing and ``loss_function`` equals
CP 1.

Init and LoRA provider, in a gloo world of one, as miles' actor calls them, on miles' own Megatron-LM fork
(megatron-core 0.16.0rc0, accepted by kimi_megatron_plugin as ``MILES_MEGATRON_FORK``):
``load_function(args.custom_megatron_init_path)(args)`` (``megatron_utils/initialize.py``) runs our init (Bridge
registration skipped with one line: Megatron-Bridge 0.6 does not import on the fork), then for tiny K3 and K3.1
checkpoints (4 layers: KDA, NoPE MLA, latent MoE with MXFP4 experts; K3.1's indexer)
``resolve_lora_provider(args).wrap_model_provider_with_lora(get_model_provider_func(args, "actor"), args)`` builds
the chunk as ``get_model`` does (``--spec kimi_megatron_plugin.spec get_spec``, W4A16 experts), our HF loader fills
the base, a random adapter goes in through the provider's ``load_lora_adapter_hf``, and one forward + backward of
the next-token cross-entropy equals kimi_core.reference in float64 with the same adapter file. CPU stand-ins (the
check's ``_cpu_fp32``): fp32 parameters, the allgather dispatcher, no activation recompute.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from miles_lane import missing_sources, run_check, script_command
from py312_lane import require

require("torch", "torch")
if (why := missing_sources()) is not None:
    pytest.skip(f"miles sources: {why}", allow_module_level=True)

K3 = "examples/miles/run_kimi_k3_lora.sh"
K31 = "examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh"
ONE_GPU = dict(NUM_NODES="1", GPUS_PER_NODE="1", TP="1", PP="1", CP="1", EP="1", ROLLOUT_TP="1", ROLLOUT_EP="1")
ONE_GPU.update(ROLLOUT_ATTN_DP="1", GLOBAL_BATCH_SIZE="16", ROLLOUT_BATCH_SIZE="1")


@pytest.fixture(scope="module")
def train_side(tmp_path_factory):
    from kimi_core.checkpoint.tiny import make_tiny

    k31 = make_tiny("k31", tmp_path_factory.mktemp("k31"), layers=4)
    k3 = make_tiny("k3", tmp_path_factory.mktemp("k3"), layers=4)
    argv, env = script_command(K31, Path(k31), ONE_GPU)
    argv3, env3 = script_command(K3, Path(k3), ONE_GPU)
    builds = [{"family": "k31", "checkpoint": k31}, {"family": "k3", "checkpoint": k3, "argv": argv3, "env": env3}]
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    payload = {"argv": argv, "env": env, "port": ports[0], "vocab": 64, "seed": 3, "builds": builds}
    payload.update(cp=2, cp_port=ports[1])
    return run_check("train_side", payload)


@pytest.fixture(scope="module")
def hooks(train_side):
    return train_side["hooks"]


@pytest.fixture(scope="module")
def dispatched(train_side):
    return train_side["loss"]


def test_topk_fields_reach_the_loss_through_miles(train_side):
    """kimi_rl_glue.miles.topk_transport: our conversion (miles' inside), miles' DP split and the train step's own
    get_batch carry rollout_topk_* from the samples to the loss, which equals the plain per-sample float64 loss
    (the fields travel as float32, like miles' rollout_log_probs)."""
    out = train_side["transport"]
    assert "ok" in out, out
    out = out["ok"]
    assert out["get_batch_wrapped"] is True
    assert {"rollout_topk_token_ids", "rollout_topk_log_probs"} <= set(out["shard_keys"])
    assert out["batch_has_topk"] is True
    assert out["loss"] == pytest.approx(out["reference"], rel=1e-6)


def test_cp2_through_miles_slicing_equals_cp1(train_side):
    """CP 2 (two forked ranks, gloo): rollout_log_probs and the advantages sliced per rank by miles'
    slice_log_prob_with_cp (as get_rollout_data and its GRPO step leave them), the top-K sliced the same way by
    the wrapped get_batch, each rank's zigzag rows of the logits, miles' loss_function: the mean over ranks of
    the returned loss (miles scales the per-token loss by the CP size) and of the logits gradient (Megatron's
    average over CP) equal CP 1's, float64. One sample's whole response lies on one rank (the other holds none)."""
    out = train_side["cp"]
    assert "ok" in out, out
    out = out["ok"]
    assert "errors" not in out, out
    assert out["topk_rows"] == out["rollout_rows"]
    assert [a + b for a, b in zip(*out["topk_rows"], strict=True)] == out["response_lengths"]
    assert 0 in out["topk_rows"][0] + out["topk_rows"][1]
    assert out["loss_cp"] == pytest.approx(out["loss_cp1"], rel=1e-12, abs=1e-12)
    assert out["grad_max_abs_diff"] <= 1e-12 * max(1.0, out["grad_max_abs"])


def test_train_step_keys_lack_topk(dispatched):
    """miles' own get_batch key list: our loss raises MissingRolloutField naming rollout_topk_token_ids."""
    err = dispatched["train_step_keys"]["error"]
    assert err.startswith("MissingRolloutField") and "rollout_topk_token_ids" in err


def test_loss_and_grad_equal_plain_per_sample_loss(dispatched):
    """Per-token loss (--calculate-per-token-loss) through miles' loss_function equals the plain float64 sum."""
    assert dispatched["calculate_per_token_loss"] is True
    assert dispatched["loss"] == pytest.approx(dispatched["reference"], rel=1e-12, abs=1e-12)
    assert dispatched["grad_max_abs_diff"] <= 1e-12 * max(1.0, dispatched["grad_max_abs"])


def test_init_runs_on_the_fork(hooks):
    """--custom-megatron-init-path resolves to our init, which runs on the fork: CPU shims, and the Bridge registration skipped with one line naming the release pair and the import that fails."""
    assert hooks["init_target"] == "kimi_rl_glue.miles.init.init"
    assert "ok" in hooks["init"], hooks["init"]
    done = hooks["init"]["ok"]
    assert done["cpu_shims"] is True and done["bridge"] is None  # (the get_batch wrap: the transport test)
    why = done["bridge_skipped"]
    assert "megatron-core 0.16.0rc0" in why and "safe_get_world_size" in why and "raw mode" in why, why
    assert "KimiK3ForConditionalGeneration" in done["plugin_models_skipped"]
    assert hooks["lora_provider_module"] == {"ok": "kimi_rl_glue.miles.lora_provider"}


@pytest.mark.parametrize("family", ["k3", "k31"])
def test_miles_provider_builds_and_trains_on_the_fork(hooks, family):
    """miles' provider wrapped by ours builds the chunk with W4A16 MXFP4 experts (packed uint8 buffers, no expert
    parameters) and trainable LoRA factors only; with a random adapter loaded through load_lora_adapter_hf the
    logits and the cross-entropy equal kimi_core.reference in float64 (fp32 model: <= 1e-4 relative RMS, like the
    megatron plugin's numerics tests), and the backward reaches every LoRA factor and no base weight."""
    out = hooks["builds"][family]
    assert "ok" in out, out
    out = out["ok"]
    assert (out["provider"], out["model"]) == ("kimi_rl_glue.miles.lora_provider", "GPTModel")
    assert out["expert_modes"] == ["w4a16"] and out["experts_packed_uint8"] and out["expert_parameters"] == 0
    assert out["trainable"] > 0 and out["adapter_tensors_loaded"] == out["trainable"]
    assert out["adapter_moves_logits_rel_rms"] > 1e-2, (
        "the adapter must change the logits for the test to mean anything"
    )
    assert out["logits_rel_rms"] <= 1e-4
    assert out["loss"] == pytest.approx(out["reference_loss"], rel=1e-5)
    assert out["lora_grads"] == out["trainable"] == out["lora_grads_nonzero"] and out["lora_grads_finite"]
    assert out["base_grads"] == 0
