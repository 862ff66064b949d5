"""The launch scripts in examples/ (miles and SkyRL recipes) in DRY_RUN mode, checked against the hosts' parsers.

Each script prints the environment and the exact host command instead of running it. The flags are
checked against miles' list (``examples/miles/miles_flags.txt``, built from miles' and Megatron-LM's
real parsers), SGLang's ``ServerArgs`` and vLLM's ``EngineArgs`` where those are importable, and
SkyRL's config dataclasses where SkyRL is installed; a host that is missing is skipped with a reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MILES_FLAGS = EXAMPLES / "miles" / "miles_flags.txt"
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"

K3 = "examples/miles/run_kimi_k3_lora.sh"
K31_H200 = "examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh"
K31_B300 = "examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh"
SKYRL = "examples/skyrl/run_megatron_dapo_kimi_k2.7_code_lora_int4_qat.sh"
MILES_SCRIPTS = [pytest.param(s, id=Path(s).stem) for s in (K3, K31_H200, K31_B300)]
ALL_SCRIPTS = MILES_SCRIPTS + [pytest.param(SKYRL, id=Path(SKYRL).stem)]

# Environment knobs a user might have set that would change the defaults under test.
_KNOBS = re.compile(
    r"^(NUM_NODES|GPUS_PER_NODE|TP|PP|CP|EP|ROLLOUT_.*|LORA_.*|DRY_RUN|MEGATRON_.*|QAT_MODE|"
    r"EXPERT_WEIGHTS|EXTRA_ARGS|HF_CHECKPOINT|MODEL_.*|DATA_DIR|SAVE_DIR|K3_.*|K31_.*)$"
)


class DryRun:
    """What a script printed under DRY_RUN=1: ``env`` (exported variables) and ``argv`` (the command)."""

    def __init__(self, text: str):
        self.text = text
        lines = text.splitlines()
        self.env = {}
        for ln in lines:
            if ln.startswith("export "):
                k, _, v = ln[len("export ") :].partition("=")
                self.env[k] = shlex.split(v)[0] if v else ""
        cmd = lines[lines.index("# command:") + 1]
        self.argv = shlex.split(cmd)

    def after(self, token_suffix: str) -> list[str]:
        """The arguments after the first token ending with ``token_suffix`` (e.g. ``train.py``)."""
        i = next(i for i, t in enumerate(self.argv) if t.endswith(token_suffix))
        return self.argv[i + 1 :]


def dry_run(script: str, **env: str) -> DryRun:
    """Run ``script`` with DRY_RUN=1 and the given knobs; fails the test on a non-zero exit."""
    r = _run(script, **env)
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stderr}"
    return DryRun(r.stdout)


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not _KNOBS.match(k)}
    return subprocess.run(
        ["bash", str(REPO / script)], env={**base, "DRY_RUN": "1", **env}, capture_output=True, text=True, timeout=60
    )


def split_flags(args: list[str]) -> list[tuple[str, list[str]]]:
    """``--flag v1 v2 --switch`` -> ``[("--flag", ["v1", "v2"]), ("--switch", [])]``."""
    out: list[tuple[str, list[str]]] = []
    for a in args:
        if a.startswith("--"):
            out.append((a.split("=", 1)[0], [a.split("=", 1)[1]] if "=" in a else []))
        else:
            assert out, f"value {a!r} before any flag"
            out[-1][1].append(a)
    return out


def miles_flags() -> dict[str, str]:
    """``{flag: nargs}`` from examples/miles/miles_flags.txt."""
    flags = {}
    for ln in MILES_FLAGS.read_text().splitlines():
        if ln and not ln.startswith("#"):
            flag, nargs, _src = ln.split("\t", 2)
            flags[flag] = nargs
    return flags


def _arity_ok(nargs: str, n: int) -> bool:
    return {"0": n == 0, "?": n <= 1, "*": True, "+": n >= 1}.get(nargs, n == int(nargs) if nargs.isdigit() else False)


def values(d: DryRun, flag: str) -> list[str]:
    """Values of the last occurrence of ``flag`` in a miles command (``[]`` for a switch); KeyError if absent."""
    found = [v for f, v in split_flags(d.after("train.py")) if f == flag]
    if not found:
        raise KeyError(flag)
    return found[-1]


# --------------------------------------------------------------------------------------------------
# all scripts


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_dry_run_prints_env_and_one_command(script):
    """DRY_RUN=1 exits 0, starts nothing and prints the knobs, the env and exactly one host command."""
    d = dry_run(script)
    assert d.text.count("# command:") == 1
    assert "# knobs" in d.text and "# env:" in d.text
    assert d.argv[0] in ("ray", "uv")


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_script_states_what_the_plugins_replace(script):
    """Every launch script's header says what our plugins replace compared with its seed."""
    head = (REPO / script).read_text().split("\nKIMI_SCRIPT_NAME", 1)[0]
    assert "What our plugins replace" in head
    assert "seed" in head.lower()


def test_entry_point_names_live_in_common_sh_only():
    """Our module paths appear in examples/common.sh and nowhere else in the launch scripts, so a rename is one edit."""
    pat = re.compile(r"kimi_rl_glue\.(miles|skyrl|losses)\.|kimi_megatron_plugin\.spec")
    offenders = []
    for p in sorted(EXAMPLES.rglob("*.sh")):
        if p.name == "common.sh":
            continue
        code = "\n".join(ln for ln in p.read_text().splitlines() if not ln.lstrip().startswith("#"))
        if pat.search(code):
            offenders.append(str(p.relative_to(REPO)))
    assert not offenders, f"module paths hard-coded outside examples/common.sh: {offenders}"


def test_entry_points_resolve_where_installed():
    """Each entry point named in common.sh resolves: modules import and functions exist (skipped, with the list, while pieces are missing)."""
    import importlib

    text = (EXAMPLES / "common.sh").read_text()
    names = dict(re.findall(r"^(KIMI_\w+)=(\S+)", text, flags=re.M))
    spec_module, spec_fn = re.search(r"KIMI_MEGATRON_SPEC=\((\S+) (\S+)\)", text).groups()
    targets = {  # knob: (module, attribute or None for a module entry point)
        "KIMI_MEGATRON_SPEC": (spec_module, spec_fn),
        "KIMI_MILES_LORA_PROVIDER": (names["KIMI_MILES_LORA_PROVIDER"], None),
        "KIMI_SKYRL_ENTRYPOINT": (names["KIMI_SKYRL_ENTRYPOINT"], "main"),
    }
    for knob in ("KIMI_MILES_INIT", "KIMI_MILES_REWARD", "KIMI_MILES_LOSS_SCORE_CENTERING"):
        targets[knob] = tuple(names[knob].rsplit(".", 1))
    missing = []
    for knob, (mod, attr) in targets.items():
        try:
            ok = importlib.util.find_spec(mod) is not None
            if ok and attr:
                ok = hasattr(importlib.import_module(mod), attr)
        except ImportError as e:  # a host the module needs is absent here
            missing.append(f"{knob}={mod}{'.' + attr if attr else ''} ({e})")
            continue
        if not ok:
            missing.append(f"{knob}={mod}{'.' + attr if attr else ''}")
    if missing:
        print("SKIP: entry points not in this checkout yet: " + ", ".join(missing))
        pytest.skip("entry points not in this checkout yet: " + ", ".join(missing))


# --------------------------------------------------------------------------------------------------
# miles


def test_miles_flag_list_names_its_sources():
    """miles_flags.txt records the miles and Megatron-LM commits and, per flag, the file that defines it."""
    text = MILES_FLAGS.read_text()
    assert re.search(r"radixark/miles@[0-9a-f]{40}", text)
    assert re.search(r"radixark/Megatron-LM@[0-9a-f]{40}", text)
    flags = miles_flags()
    assert len(flags) > 900
    assert "--custom-megatron-init-path" in flags and "--spec" in flags and "--lora-rank" in flags


@pytest.mark.parametrize("script", MILES_SCRIPTS)
def test_miles_flags_exist_with_the_right_arity(script):
    """Every train.py flag is a miles/Megatron flag (or an --sglang-* ServerArgs flag) and gets as many values as it takes."""
    known = miles_flags()
    d = dry_run(script)
    unknown, arity = [], []
    for flag, vals in split_flags(d.after("train.py")):
        if flag not in known:
            if not flag.startswith(("--sglang-", "--no-sglang-")):
                unknown.append(flag)
            continue
        if not _arity_ok(known[flag], len(vals)):
            arity.append(f"{flag} takes {known[flag]} value(s), got {vals}")
    assert not unknown, f"not miles or Megatron flags (examples/miles/miles_flags.txt): {unknown}"
    assert not arity, arity


def _sglang_server_flags() -> set[str] | None:
    """Option strings of SGLang's ``ServerArgs.add_cli_args``, in-process or via .venv-sglang; None if unavailable."""
    code = (
        "import argparse, json\nfrom sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser()\nServerArgs.add_cli_args(p)\n"
        "print(json.dumps(sorted({s for a in p._actions for s in a.option_strings})))\n"
    )
    if importlib.util.find_spec("sglang") is not None:
        ns: dict = {}
        try:
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(code, ns)
            return set(json.loads(buf.getvalue().strip().splitlines()[-1]))
        except Exception:
            pass
    if SGLANG_PY.exists():
        r = subprocess.run([str(SGLANG_PY), "-c", code], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return set(json.loads(r.stdout.strip().splitlines()[-1]))
    return None


@pytest.fixture(scope="module")
def sglang_flags():
    flags = _sglang_server_flags()
    if flags is None:
        reason = "sglang is not importable here or in .venv-sglang (ServerArgs unavailable); --sglang-* flags unchecked"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return flags


@pytest.mark.parametrize("script", MILES_SCRIPTS)
def test_miles_sglang_flags_are_server_args(script, sglang_flags):
    """Each --sglang-X flag miles forwards to SGLang (not one of miles' own) is an SGLang ServerArgs flag --X."""
    known = miles_flags()
    d = dry_run(script)
    bad = []
    for flag, _ in split_flags(d.after("train.py")):
        if flag in known or not flag.startswith(("--sglang-", "--no-sglang-")):
            continue
        server_flag = flag.replace("--no-sglang-", "--no-", 1).replace("--sglang-", "--", 1)
        if server_flag not in sglang_flags:
            bad.append(flag)
    assert not bad, f"not SGLang ServerArgs flags: {bad}"


@pytest.mark.parametrize("script", MILES_SCRIPTS)
def test_miles_uses_our_entry_points_and_no_kimi_branch(script):
    """The miles command loads our spec, init hook, LoRA provider and reward, SGLANG_PLUGINS=kimi reaches the Ray workers, and nothing points at a Kimi branch."""
    d = dry_run(script)
    args = d.after("train.py")
    assert values(d, "--spec") == ["kimi_megatron_plugin.spec", "get_spec"]
    assert values(d, "--custom-megatron-init-path") == ["kimi_rl_glue.miles.init"]
    assert values(d, "--lora-provider-path") == ["kimi_rl_glue.miles.lora_provider"]
    assert values(d, "--custom-rm-path")[0].startswith("kimi_rl_glue.miles.reward.")
    runtime = json.loads(next(a for a in d.argv if a.startswith("--runtime-env-json=")).split("=", 1)[1])
    assert runtime["env_vars"]["SGLANG_PLUGINS"] == "kimi"
    # the native checkpoint serves as both the rollout and the trainer source: no BF16 / torch_dist copy
    assert values(d, "--hf-checkpoint") == values(d, "--ref-load")
    joined = " ".join(args)
    assert "miles_plugins.models.kimi_k3" not in joined and "torch_dist" not in joined


def test_k3_defaults_are_the_seed():
    """run_kimi_k3_lora.sh defaults reproduce seed 000: 16x4 GPUs, TP4 PP8 CP2 EP8, rollout TP16, rank 32/64, 8x8 prompts, AIME every 10."""
    d = dry_run(K3)
    expect = {
        "--actor-num-nodes": ["16"],
        "--actor-num-gpus-per-node": ["4"],
        "--tensor-model-parallel-size": ["4"],
        "--pipeline-model-parallel-size": ["8"],
        "--context-parallel-size": ["2"],
        "--expert-model-parallel-size": ["8"],
        "--sglang-tp-size": ["16"],
        "--lora-rank": ["32"],
        "--lora-alpha": ["64"],
        "--rollout-batch-size": ["8"],
        "--n-samples-per-prompt": ["8"],
        "--global-batch-size": ["64"],
        "--rollout-max-response-len": ["4096"],
        "--sglang-max-total-tokens": ["65536"],
        "--sglang-max-running-requests": ["8"],
        "--max-tokens-per-gpu": ["8192"],
        "--eval-interval": ["10"],
        "--num-rollout": ["1000"],
        "--lr": ["1e-5"],
        "--decoder-first-pipeline-num-layers": ["12"],
        "--decoder-last-pipeline-num-layers": ["9"],
        "--distributed-timeout-minutes": ["60"],
    }
    assert {k: values(d, k) for k in expect} == expect
    assert values(d, "--lora-base-cpu-backup") == []


def test_k31_h200_defaults_are_the_seed():
    """The 32xH200 script reproduces seed 001: TP4 PP4 CP2 EP8 (24/21 layers), score centering on top-128, 32x16, saves every 5."""
    d = dry_run(K31_H200)
    expect = {
        "--actor-num-nodes": ["4"],
        "--actor-num-gpus-per-node": ["8"],
        "--tensor-model-parallel-size": ["4"],
        "--pipeline-model-parallel-size": ["4"],
        "--context-parallel-size": ["2"],
        "--expert-model-parallel-size": ["8"],
        "--decoder-first-pipeline-num-layers": ["24"],
        "--decoder-last-pipeline-num-layers": ["21"],
        "--sglang-tp-size": ["32"],
        "--sglang-ep-size": ["32"],
        "--sglang-dp-size": ["4"],
        "--sglang-max-total-tokens": ["262144"],
        "--rollout-batch-size": ["32"],
        "--n-samples-per-prompt": ["16"],
        "--global-batch-size": ["512"],
        "--rollout-max-response-len": ["3072"],
        "--rollout-top-logprobs-num": ["128"],
        "--loss-type": ["custom_loss"],
        "--save-interval": ["5"],
        "--sglang-kv-cache-dtype": ["bfloat16"],
    }
    assert {k: values(d, k) for k in expect} == expect
    for switch in (
        "--lora-base-cpu-backup",
        "--use-rollout-routing-replay",
        "--disable-grpo-std-normalization",
        "--use-rollout-logprobs",
        "--calculate-per-token-loss",
        "--experts-shared-outer-loras",
    ):
        assert values(d, switch) == [], switch
    assert "--check-lora-weight-equal" not in d.argv
    assert d.env["NCCL_RAS_ENABLE"] == "0" and d.env["SGLANG_DSA_TOPK_BROADCAST"] == "1"


def test_k31_b300_defaults_are_the_seed():
    """The 16xB300 script: PP2 (47/46), one TP16/EP16 engine with attention DP 2, 16x16 with the dynamic filter, base re-sent each sync."""
    d = dry_run(K31_B300)
    assert d.text.startswith("# DRY_RUN=1: examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh")
    expect = {
        "--actor-num-nodes": ["2"],
        "--pipeline-model-parallel-size": ["2"],
        "--decoder-first-pipeline-num-layers": ["47"],
        "--decoder-last-pipeline-num-layers": ["46"],
        "--sglang-tp-size": ["16"],
        "--sglang-ep-size": ["16"],
        "--sglang-dp-size": ["2"],
        "--sglang-max-total-tokens": ["524288"],
        "--rollout-batch-size": ["16"],
        "--global-batch-size": ["256"],
        "--over-sampling-batch-size": ["4"],
    }
    assert {k: values(d, k) for k in expect} == expect
    assert "--dynamic-sampling-filter-path" in d.argv
    assert "--lora-base-cpu-backup" not in d.argv


def test_knobs_shrink_the_run_and_bad_layouts_fail_early():
    """Scale knobs from the environment reach the command; a layout that does not divide the GPUs exits 2 naming the knobs."""
    d = dry_run(K3, NUM_NODES="1", GPUS_PER_NODE="8", TP="8", PP="1", CP="1", EP="8", ROLLOUT_TP="8")
    assert values(d, "--tensor-model-parallel-size") == ["8"] and values(d, "--sglang-tp-size") == ["8"]
    assert "--decoder-first-pipeline-num-layers" not in d.argv
    assert "--no-sglang-lora-use-virtual-experts" not in d.argv  # only above rollout TP8
    r = _run(K3, NUM_NODES="1", GPUS_PER_NODE="8", TP="3", PP="1", CP="1")
    assert r.returncode == 2 and "TP*PP*CP" in r.stderr


@pytest.mark.parametrize("script,release", [pytest.param(K3, "k3", id="k3"), pytest.param(K31_H200, "k31", id="k31")])
def test_model_args_match_the_release_config(script, release):
    """The Megatron model sizes in examples/miles/models/*.sh equal kimi_core's release configs."""
    from kimi_core import release_configs

    cfg = getattr(release_configs, f"{release}_release_config")()
    t = cfg["text_config"]
    d = dry_run(script)
    got = {
        k: int(values(d, k)[0])
        for k in (
            "--num-layers",
            "--hidden-size",
            "--ffn-hidden-size",
            "--num-attention-heads",
            "--vocab-size",
            "--q-lora-rank",
            "--kv-lora-rank",
            "--num-experts",
            "--moe-router-topk",
            "--moe-ffn-hidden-size",
            "--moe-latent-size",
            "--moe-shared-expert-intermediate-size",
        )
    }
    assert got == {
        "--num-layers": t["num_hidden_layers"],
        "--hidden-size": t["hidden_size"],
        "--ffn-hidden-size": t["intermediate_size"],
        "--num-attention-heads": t["num_attention_heads"],
        "--vocab-size": t["vocab_size"],
        "--q-lora-rank": t["q_lora_rank"],
        "--kv-lora-rank": t["kv_lora_rank"],
        "--num-experts": t["num_experts"],
        "--moe-router-topk": t["num_experts_per_token"],
        "--moe-ffn-hidden-size": t["moe_intermediate_size"],
        "--moe-latent-size": t["routed_expert_hidden_size"],
        "--moe-shared-expert-intermediate-size": t["num_shared_experts"] * t["moe_intermediate_size"],
    }
    freq = eval(values(d, "--moe-layer-freq")[0], {"__builtins__": {}})  # Megatron evaluates it the same way
    assert (
        len(freq) == t["num_hidden_layers"] and freq[: t["first_k_dense_replace"]] == [0] * t["first_k_dense_replace"]
    )
    if release == "k31":
        assert [
            int(values(d, f)[0]) for f in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk")
        ] == [t["index_n_heads"], t["index_head_dim"], t["index_topk"]]


# --------------------------------------------------------------------------------------------------
# SkyRL


def skyrl_overrides(d: DryRun) -> dict[str, str]:
    args = d.after("skyrl.train.entrypoints.main_base")
    keys = [a.split("=", 1)[0] for a in args]
    assert len(keys) == len(set(keys)), f"duplicate overrides: {sorted(k for k in keys if keys.count(k) > 1)}"
    assert all("=" in a and not a.startswith("+") for a in args), args
    return dict(a.split("=", 1) for a in args)


def test_skyrl_defaults_are_the_seed_with_our_entrypoint():
    """The SkyRL command enters through kimi_rl_glue.skyrl.main with the seed's layout: 2x8, vLLM TP8 x2, TP2 CP8 EP16, 262,144 tokens, DAPO + TIS."""
    d = dry_run(SKYRL)
    o = skyrl_overrides(d)
    assert d.after("skyrl.train.entrypoints.main_base")[0] == "trainer.override_entrypoint=kimi_rl_glue.skyrl.main"
    assert d.env["VLLM_PLUGINS"] == "kimi"
    expect = {
        "trainer.placement.policy_num_nodes": "2",
        "trainer.placement.policy_num_gpus_per_node": "8",
        "generator.inference_engine.num_engines": "2",
        "generator.inference_engine.tensor_parallel_size": "8",
        "trainer.policy.megatron_config.tensor_model_parallel_size": "2",
        "trainer.policy.megatron_config.context_parallel_size": "8",
        "trainer.policy.megatron_config.expert_model_parallel_size": "16",
        "trainer.policy.megatron_config.expert_tensor_parallel_size": "1",
        "trainer.policy.megatron_config.pipeline_model_parallel_size": "1",
        "trainer.max_prompt_length": "8192",
        "generator.sampling_params.max_generate_length": str(262144 - 8192),
        "trainer.algorithm.policy_loss_type": "dual_clip",
        "trainer.algorithm.eps_clip_high": "0.28",
        "trainer.algorithm.off_policy_correction.tis_ratio_type": "token",
        "trainer.policy.megatron_config.lora_config.merge_lora": "false",
        "trainer.policy.model.kimi.normalize_moe_lora": "true",
        "trainer.policy.language_model_only": "true",
        "generator.inference_engine.language_model_only": "true",
        "trainer.policy.model.lora.rank": "32",
        "trainer.policy.model.path": "moonshotai/Kimi-K2.7-Code",
    }
    assert {k: o[k] for k in expect} == expect
    assert json.loads(o["generator.inference_engine.engine_init_kwargs"])["max_model_len"] == 262144


def test_skyrl_expert_weights_modes():
    """EXPERT_WEIGHTS=int4 (default) needs no BF16 masters; =bf16 is the seed's path with fake-INT4 QAT (7.0, -7); QAT_MODE=off turns TIS off."""
    o = skyrl_overrides(dry_run(SKYRL))
    assert o["trainer.policy.model.kimi.expert_weights"] == "int4"
    assert "trainer.policy.model.fake_int4_qat.bf16_base_path" not in o
    o = skyrl_overrides(dry_run(SKYRL, EXPERT_WEIGHTS="bf16"))
    assert o["trainer.policy.model.fake_int4_qat.enabled"] == "true"
    assert (o["trainer.policy.model.fake_int4_qat.scale_divisor"], o["trainer.policy.model.fake_int4_qat.q_min"]) == (
        "7.0",
        "-7",
    )
    o = skyrl_overrides(dry_run(SKYRL, EXPERT_WEIGHTS="bf16", QAT_MODE="off"))
    assert o["trainer.policy.model.fake_int4_qat.enabled"] == "false"
    assert o["trainer.algorithm.off_policy_correction.tis_ratio_type"] == "null"
    assert _run(SKYRL, QAT_MODE="maybe").returncode == 2


def skyrl_vllm_engine_kwargs(o: dict[str, str]) -> dict:
    """The vLLM engine arguments SkyRL derives from the overrides (NovaSky-AI/SkyRL: skyrl/backends/skyrl_train/inference_servers/utils.py, build_vllm_cli_args).

    ``engine_init_kwargs`` pass through unchanged; with LoRA and ``merge_lora=false`` SkyRL adds
    ``enable_lora``, ``max_lora_rank`` (= the LoRA rank), ``max_loras`` and ``fully_sharded_loras``.
    """
    ie = "generator.inference_engine."
    kw = {
        "model": o["trainer.policy.model.path"],
        "tensor_parallel_size": int(o[ie + "tensor_parallel_size"]),
        "gpu_memory_utilization": float(o[ie + "gpu_memory_utilization"]),
        "enforce_eager": o[ie + "enforce_eager"] == "true",
        "distributed_executor_backend": o[ie + "distributed_executor_backend"],
        "language_model_only": o[ie + "language_model_only"] == "true",
        "enable_lora": True,
        "max_lora_rank": int(o["trainer.policy.model.lora.rank"]),
        "max_loras": 1,
        "fully_sharded_loras": False,
    }
    kw.update(json.loads(o[ie + "engine_init_kwargs"]))
    return kw


def _to_cli(kw: dict) -> list[str]:
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif isinstance(v, dict):
            argv += [flag, json.dumps(v)]
        else:
            argv += [flag, str(v)]
    return argv


@pytest.fixture(scope="module")
def vllm_engine_args():
    if importlib.util.find_spec("vllm") is None:
        reason = "vllm is not importable in this environment; vLLM engine arguments unchecked"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs, EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="seed"),
        pytest.param(
            {
                "NUM_NODES": "1",
                "NUM_INFERENCE_ENGINES": "4",
                "INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE": "2",
                "MEGATRON_CP": "1",
                "MEGATRON_EP": "8",
                "MAX_MODEL_LEN": "4096",
                "MAX_PROMPT_LENGTH": "512",
                "LORA_RANK": "8",
            },
            id="smoke",
        ),
    ],
)
def test_skyrl_vllm_engine_args_parse(knobs, vllm_engine_args):
    """The vLLM engine SkyRL would start from these overrides is valid for vLLM's EngineArgs: field names and the real CLI parser (types, choices, nested configs)."""
    import dataclasses

    EngineArgs, parser = vllm_engine_args
    kw = skyrl_vllm_engine_kwargs(skyrl_overrides(dry_run(SKYRL, **knobs)))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert not set(kw) - fields, f"not EngineArgs fields: {sorted(set(kw) - fields)}"
    ns = parser.parse_args(_to_cli(kw))
    assert ns.tensor_parallel_size == kw["tensor_parallel_size"] and ns.max_model_len == kw["max_model_len"]
    assert ns.max_lora_rank == kw["max_lora_rank"] and ns.language_model_only
    cc = ns.compilation_config
    mode = cc["cudagraph_mode"] if isinstance(cc, dict) else cc.cudagraph_mode
    assert str(mode).endswith("FULL_DECODE_ONLY")
