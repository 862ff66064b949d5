"""The K2.x recipe and the examples/skyrl launch script against the REAL skyrl 0.4.0 config schema and entry point.

Oracles: SkyRL's own dataclasses (``SkyRLTrainConfig``, strict ``from_cli_overrides``), their
field annotations (every value we pass has the declared type), SkyRL's ``validate_cfg`` and
``main_base.main()`` dispatch of ``trainer.override_entrypoint``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import typing

import pytest
import torch
from py312_lane import require
from utils import skyrl_dry_run_overrides

skyrl_config = require("skyrl.train.config", "skyrl==0.4.0")
import skyrl.train.utils as skyrl_utils
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
from skyrl.train.entrypoints import main_base

from kimi_rl_glue.skyrl.config import build_config, check_config
from kimi_rl_glue.skyrl.main import build_classes, strip_override_arg
from kimi_rl_glue.skyrl.recipe import K2xRecipe
from kimi_rl_glue.skyrl.registry import SKYRL_LOSSES, register_skyrl_losses

OURS = ("trainer.override_entrypoint", "trainer.policy.model.kimi.", "trainer.algorithm.overlong_")
RECIPES = {"qat": dict(qat=True, bf16_base_path="/ckpt/k2-bf16"), "int4": dict(qat=False)}
# SkyRL 0.4.0 annotates lora.target_modules as ``str`` ("all-linear"), but its Megatron worker hands any other
# value straight to Bridge's LoRA(target_modules=[...]) and its adapter store accepts a sequence: a list is the
# working form (the seed script passes one), the annotation is loose
LOOSE = {"trainer.policy.model.lora.target_modules": list}


def _optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig


def _transformer_config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig


# megatron_config dicts SkyRL's Megatron worker unpacks into megatron-core configs
PASS_THROUGH = {"optimizer_config_kwargs": _optimizer_config, "transformer_config_kwargs": _transformer_config}


@pytest.fixture
def no_kimi_losses():
    """SkyRL's process-global registry without our losses before and after the test."""

    def drop():
        for name in SKYRL_LOSSES:
            if name in PolicyLossRegistry.list_available():
                PolicyLossRegistry.unregister(name)

    drop()
    yield
    drop()


def _field_type(obj, name: str):
    hints = typing.get_type_hints(type(obj))
    return hints[name]


def _type_ok(value, t) -> bool:
    origin = typing.get_origin(t)
    if t is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(t))
    if t is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(t)
    if origin in (list, list):
        (a,) = typing.get_args(t) or (typing.Any,)
        seq = isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (str, dict)))
        return seq and all(_type_ok(v, a) for v in value)
    if origin in (dict, dict):
        return hasattr(value, "keys")
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, t)


def _check_keys(cfg, overrides: list[str]) -> int:
    """Every ``a.b.c=v`` is a field chain of ``cfg`` whose value has the field's declared type; returns the count."""
    n = 0
    for o in overrides:
        key = o.split("=", 1)[0]
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            assert dataclasses.is_dataclass(node) and hasattr(node, p), f"{key}: {p!r} is not a SkyRL config section"
            node = getattr(node, p)
        leaf = parts[-1]
        if isinstance(node, dict) and parts[-2] in PASS_THROUGH:
            # SkyRL forwards these free-form dicts as keyword arguments: check against the receiving class
            target = PASS_THROUGH[parts[-2]]()
            fields = {f.name: f for f in dataclasses.fields(target)}
            assert leaf in fields, f"{key}: SkyRL passes it to {target.__name__}, which has no field {leaf!r}"
            t = typing.get_type_hints(target)[leaf]
            assert _type_ok(node[leaf], t), f"{key}={node[leaf]!r} does not match {target.__name__}.{leaf}: {t}"
            n += 1
            continue
        assert dataclasses.is_dataclass(node) and leaf in {f.name for f in dataclasses.fields(node)}, (
            f"{key}: not a field of {type(node).__name__}"
        )
        t = LOOSE.get(key) or _field_type(node, leaf)
        v = getattr(node, leaf)
        assert _type_ok(v, t), f"{key}={v!r} ({type(v).__name__}) does not match SkyRL's declared type {t}"
        n += 1
    return n


@pytest.mark.parametrize("mode", sorted(RECIPES))
def test_recipe_overrides_fit_skyrl_schema(mode):
    """Each recipe override is a real SkyRL field of the declared type (ours only under kimi.* / overlong_*), with the recipe's value."""
    rec = K2xRecipe(model_path="/ckpt/k2-int4", moe_router_topk=8, **RECIPES[mode])
    o = strip_override_arg(rec.overrides())
    skyrl_only = [x for x in o if not x.startswith(OURS)]
    plain = skyrl_config.SkyRLTrainConfig.from_cli_overrides(skyrl_only)  # strict: unknown keys raise
    assert _check_keys(plain, skyrl_only) == len(skyrl_only)
    cfg = build_config(skyrl_config).from_cli_overrides(o)
    assert _check_keys(cfg, o) == len(o)
    check_config(cfg)
    m, mc, alg = cfg.trainer.policy.model, cfg.trainer.policy.megatron_config, cfg.trainer.algorithm
    assert mc.lora_config.merge_lora is False and m.kimi.normalize_moe_lora is True
    assert cfg.trainer.policy.language_model_only and cfg.generator.inference_engine.language_model_only
    assert m.lora.rank == 32 and list(m.lora.target_modules) == ["linear_proj", "linear_fc1", "linear_fc2"]
    assert alg.off_policy_correction.tis_ratio_type == "token"
    assert alg.off_policy_correction.token_tis_ratio_clip_high == 2.0 and alg.clip_ratio_c == 10.0
    assert (alg.eps_clip_low, alg.eps_clip_high, alg.policy_loss_type) == (0.2, 0.28, "kimi_dapo")
    if mode == "qat":
        q = m.fake_int4_qat
        assert (q.enabled, q.group_size, q.scale_divisor, q.q_min, q.bf16_base_path) == (
            True,
            32,
            7.0,
            -7,
            "/ckpt/k2-bf16",
        )
        assert m.kimi.expert_weights == "bf16"
    else:
        assert not m.fake_int4_qat.enabled and m.kimi.expert_weights == "int4"
    # defaults we rely on but do not pass
    assert skyrl_config.SkyRLTrainConfig().trainer.policy.megatron_config.lora_config.normalize_moe_lora is False


def test_validate_cfg_needs_our_registration(no_kimi_losses, monkeypatch):
    """SkyRL's validate_cfg rejects policy_loss_type=kimi_dapo until register_skyrl_losses() ran, then accepts the recipe."""
    monkeypatch.setenv("WANDB_API_KEY", "unused")
    cfg = build_config(skyrl_config).from_cli_overrides(
        strip_override_arg(K2xRecipe(model_path="/m", bf16_base_path="/b", moe_router_topk=8).overrides())
    )
    with pytest.raises(Exception, match="kimi_dapo"):
        skyrl_utils.validate_cfg(cfg)
    register_skyrl_losses()
    skyrl_utils.validate_cfg(cfg)


class _Stop(Exception):
    pass


def test_skyrl_main_dispatches_to_our_entrypoint(no_kimi_losses, monkeypatch):
    """skyrl's main_base.main() with trainer.override_entrypoint=kimi_rl_glue.skyrl.main parses our extended config, registers our losses and passes SkyRL's validation (stopped at Ray start)."""
    seen = {}

    def fake_ray(cfg):
        seen["cfg"] = cfg
        raise _Stop

    monkeypatch.setattr(skyrl_utils, "initialize_ray", fake_ray)
    monkeypatch.setenv("WANDB_API_KEY", "unused")
    rec = K2xRecipe(model_path="/m", bf16_base_path="/b", moe_router_topk=8)
    monkeypatch.setattr(sys, "argv", ["main_base", *rec.overrides()])
    with pytest.raises(_Stop):
        main_base.main()
    cfg = seen["cfg"]
    assert cfg.trainer.algorithm.overlong_buffer_len == 4096 and cfg.trainer.policy.model.kimi.expert_weights == "bf16"
    assert PolicyLossRegistry.get(cfg.trainer.algorithm.policy_loss_type) is SKYRL_LOSSES["kimi_dapo"]


def test_trainer_override_keeps_skyrl_signature(monkeypatch):
    """KimiTrainer.postprocess_generator_output has RayPPOTrainer's 0.4.0 signature and shapes both outputs' rewards as DAPO eq. 13 (float64 oracle)."""
    from skyrl.train.trainer import RayPPOTrainer

    _, KimiTrainer, KimiExp = build_classes()
    ours = inspect.signature(KimiTrainer.postprocess_generator_output).parameters
    theirs = inspect.signature(RayPPOTrainer.postprocess_generator_output).parameters
    assert list(ours) == list(theirs)
    seen = {}
    monkeypatch.setattr(
        RayPPOTrainer,
        "postprocess_generator_output",
        lambda self, g, u, m=None, mu=None: seen.setdefault("args", (g, u, m, mu)),
    )
    cfg = build_config(skyrl_config).from_cli_overrides(
        ["trainer.algorithm.overlong_buffer_len=4", "generator.sampling_params.max_generate_length=10"]
    )
    trainer = object.__new__(KimiTrainer)
    trainer.cfg = cfg
    lengths = [3, 6, 7, 10, 12]
    out = {"rewards": [1.0] * 5, "response_ids": [[0] * n for n in lengths]}
    metrics_out = {"rewards": [0.5] * 5, "response_ids": [[0] * n for n in lengths]}
    trainer.postprocess_generator_output(out, ["u"] * 5, metrics_generator_output=metrics_out, metrics_uids=["u"] * 5)

    def dapo(r, n, lmax=10, buf=4):  # DAPO eq. 13, written out
        return 0.0 if n > lmax else r - max(0.0, n - (lmax - buf)) / buf

    assert out["rewards"] == pytest.approx([dapo(1.0, n) for n in lengths], abs=1e-12)
    assert metrics_out["rewards"] == pytest.approx([dapo(0.5, n) for n in lengths], abs=1e-12)
    assert seen["args"][2] is metrics_out and seen["args"][3] == ["u"] * 5
    assert issubclass(KimiExp, main_base.BasePPOExp)


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="int4"),
        pytest.param({"EXPERT_WEIGHTS": "bf16"}, id="bf16"),
        pytest.param({"EXPERT_WEIGHTS": "bf16", "QAT_MODE": "off"}, id="bf16-noqat"),
    ],
)
def test_example_script_dry_run_parses_and_validates(knobs, no_kimi_losses, monkeypatch):
    """examples/skyrl DRY_RUN=1 command: SkyRL's strict parser (extended by ours) accepts every key with its declared type; check_config and SkyRL's validate_cfg pass."""
    monkeypatch.setenv("WANDB_API_KEY", "unused")
    argv = strip_override_arg(skyrl_dry_run_overrides(**knobs))
    cfg = build_config(skyrl_config).from_cli_overrides(argv)
    assert _check_keys(cfg, argv) == len(argv)
    check_config(cfg)
    register_skyrl_losses()
    skyrl_utils.validate_cfg(cfg)
    assert cfg.trainer.policy.model.kimi.expert_weights == knobs.get("EXPERT_WEIGHTS", "int4")


def test_loss_reads_skyrl_config_through_megatron_override_path():
    """SkyRL's loss_fn_config override path rebuilds our config class via from_dict_config; the loss still reads it."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    alg = build_config(skyrl_config)().trainer.algorithm
    merged = OmegaConf.merge(OmegaConf.create(asdict(alg)), OmegaConf.create({"eps_clip_high": 0.5}))
    alg2 = type(alg).from_dict_config(merged)
    assert alg2.eps_clip_high == 0.5 and alg2.overlong_buffer_len == 0
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = SKYRL_LOSSES["kimi_grpo"](lp, torch.zeros(1, 3), torch.ones(1, 3), alg2, torch.ones(1, 3), None)
    assert loss.item() == pytest.approx(-3.0)
