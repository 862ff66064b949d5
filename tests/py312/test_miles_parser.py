"""miles' own argument parser (train.py's ``parse_args``, at the commit examples/common.sh pins, on its Megatron-LM
fork, with ``--sglang-*`` from SGLang's ``ServerArgs``) accepts each miles launch script's whole command line,
and resolves our entry points to the values the scripts name.

The scripts run as shipped (``DRY_RUN=1`` prints the command) on a smoke layout of one 8-GPU node with a tiny
K3 / K3.1 ``config.json`` as ``--hf-checkpoint``, so miles' check of the Megatron sizes against the HF config
runs too. Skipped, with the reason, when the lane has no miles sources (``miles_lane.missing_sources``).
"""

from __future__ import annotations

import pytest
from miles_lane import missing_sources, run_check, script_command, tiny_checkpoint
from py312_lane import require

require("torch", "torch")
if (why := missing_sources()) is not None:
    pytest.skip(f"miles sources: {why}", allow_module_level=True)

K3 = "examples/miles/run_kimi_k3_lora.sh"
K31 = "examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh"
K31_B300 = "examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh"
SMOKE = dict(NUM_NODES="1", GPUS_PER_NODE="8", TP="2", PP="2", CP="2", EP="4", ROLLOUT_TP="8", ROLLOUT_EP="8")
SMOKE_K31 = dict(SMOKE, ROLLOUT_ATTN_DP="1", GLOBAL_BATCH_SIZE="32", ROLLOUT_BATCH_SIZE="2")
KEYS = [
    "spec",
    "custom_megatron_init_path",
    "lora_provider_path",
    "custom_rm_path",
    "loss_type",
    "custom_loss_function_path",
    "custom_generate_function_path",
    "custom_convert_samples_to_train_data_path",
    "rollout_top_logprobs_num",
    "megatron_to_hf_mode",
    "model_name",
    "lora_rank",
    "num_layers",
    "tensor_model_parallel_size",
    "context_parallel_size",
    "sglang_tp_size",
    "use_rollout_routing_replay",
]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """miles' parsed arguments of each script, all parsed in one child process (one import of miles)."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt = {m: tiny_checkpoint(m, root / m) for m in ("k3", "k31")}
    runs = {K3: ("k3", SMOKE), K31: ("k31", SMOKE_K31), K31_B300: ("k31", SMOKE_K31)}
    commands = {script: script_command(script, ckpt[m], knobs) for script, (m, knobs) in runs.items()}
    payload = {"runs": [{"argv": a, "env": e} for a, e in commands.values()], "keys": KEYS}
    return dict(zip(commands, run_check("parse", payload)["parsed"], strict=True))


def test_k3_script_parses_in_miles(parsed):
    """The K3 script's flags: miles resolves --spec, the init, LoRA provider and reward paths as the script names."""
    args = parsed[K3]
    assert args["spec"] == ["kimi_megatron_plugin.spec", "get_spec"]
    assert args["custom_megatron_init_path"] == "kimi_rl_glue.miles.init"
    assert args["lora_provider_path"] == "kimi_rl_glue.miles.lora_provider"
    assert args["custom_rm_path"] == "kimi_rl_glue.miles.reward.math_rm"
    assert (args["megatron_to_hf_mode"], args["model_name"], args["lora_rank"]) == ("raw", "kimi_k3", 32)
    assert (args["num_layers"], args["tensor_model_parallel_size"], args["context_parallel_size"]) == (5, 2, 2)
    assert args["sglang_tp_size"] == 8


@pytest.mark.parametrize("script", [K31, K31_B300])
def test_k31_scripts_parse_in_miles(parsed, script):
    """The K3.1 scripts: score centering as miles' custom loss, and --rollout-top-logprobs-num defined by our
    generate function (miles calls its add_arguments while parsing) with the script's K."""
    args = parsed[script]
    assert args["loss_type"] == "custom_loss"
    assert args["custom_loss_function_path"] == "kimi_rl_glue.miles.losses.score_centering_loss"
    assert args["custom_generate_function_path"] == "kimi_rl_glue.miles.topk_rollout.generate"
    assert args["custom_convert_samples_to_train_data_path"] == (
        "kimi_rl_glue.miles.topk_transport.convert_samples_to_train_data"
    )
    assert args["rollout_top_logprobs_num"] == 128
    assert args["lora_provider_path"] == "kimi_rl_glue.miles.lora_provider"
    assert (args["model_name"], args["use_rollout_routing_replay"]) == ("kimi_k31", True)
