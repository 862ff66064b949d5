"""SkyRL adapter (kimi_rl_glue/skyrl/): losses with SkyRL's signature, registration, K2.x recipe, entrypoint helpers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from utils import assert_close

from kimi_core.checkpoint.tiny import tiny_config
from kimi_rl_glue.losses.policy import policy_loss
from kimi_rl_glue.skyrl.losses import kimi_dapo_policy_loss, kimi_grpo_policy_loss
from kimi_rl_glue.skyrl.main import shape_rewards, strip_override_arg
from kimi_rl_glue.skyrl.recipe import K2xRecipe, RecipeError
from kimi_rl_glue.skyrl.registry import SKYRL_LOSSES, register_skyrl_losses


def _config(tis=None, **kw):
    opc = SimpleNamespace(
        tis_ratio_type=tis,
        token_tis_ratio_clip_high=2.0,
        sequence_tis_ratio_clip_high=5.0,
        sequence_mask_metric=None,
        outlier_token_is_threshold_low=None,
        outlier_token_is_threshold_high=None,
        token_mask_is_threshold_low=None,
        token_mask_is_threshold_high=None,
    )
    base = dict(eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=10.0, off_policy_correction=opc, use_tis=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _tensors():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g)
    lp = old + 0.5 * torch.randn(4, 6, generator=g)
    roll = old + 0.3 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    return lp, old, adv, mask, roll


@pytest.mark.parametrize("tis", [None, "token", "sequence"])
def test_skyrl_losses_are_masked_sums_of_the_plain_loss(tis):
    """kimi_dapo/kimi_grpo return the plain loss with reduction 'sum' (SkyRL pre-scales advantages) and float metrics."""
    lp, old, adv, mask, roll = _tensors()
    got, metrics = kimi_dapo_policy_loss(lp, old, adv, _config(tis), mask, roll)
    ref, _ = policy_loss(
        lp, old, adv, mask, roll, eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, reduction="sum", tis_type=tis
    )
    assert_close("skyrl dapo", ref.reshape(1), got.reshape(1), 1e-7)
    got2, _ = kimi_grpo_policy_loss(lp, old, adv, _config(tis), mask, roll)
    ref2, _ = policy_loss(
        lp, old, adv, mask, roll, eps_low=0.2, eps_high=0.28, clip_ratio_c=None, reduction="sum", tis_type=tis
    )
    assert_close("skyrl grpo", ref2.reshape(1), got2.reshape(1), 1e-7)
    assert all(isinstance(v, float) for v in metrics.values())


def test_skyrl_mask_options_are_refused_by_name():
    """SkyRL-only masking options and the deprecated use_tis raise errors naming the config key."""
    lp, old, adv, mask, roll = _tensors()
    cfg = _config()
    cfg.off_policy_correction.sequence_mask_metric = "geometric"
    with pytest.raises(ValueError, match="off_policy_correction.sequence_mask_metric"):
        kimi_dapo_policy_loss(lp, old, adv, cfg, mask, roll)
    with pytest.raises(ValueError, match="use_tis"):
        kimi_dapo_policy_loss(lp, old, adv, _config(use_tis=True), mask, roll)


class FakeRegistry:
    """Class-level registry with SkyRL's PolicyLossRegistry classmethods (register raises on duplicates)."""

    _functions: dict = {}

    @classmethod
    def register(cls, name, fn):
        if name in cls._functions:
            raise ValueError(f"policy loss '{name}' already registered")
        cls._functions[name] = fn

    @classmethod
    def get(cls, name):
        return cls._functions[name]

    @classmethod
    def list_available(cls):
        return list(cls._functions)


def test_registration_is_idempotent_and_detects_conflicts():
    """Registering twice adds nothing the second time; a foreign function under our name raises naming it."""
    FakeRegistry._functions = {"regular": print}
    assert register_skyrl_losses(FakeRegistry) == list(SKYRL_LOSSES)
    assert register_skyrl_losses(FakeRegistry) == []
    assert FakeRegistry.get("kimi_dapo") is kimi_dapo_policy_loss
    FakeRegistry._functions = {"kimi_dapo": print}
    with pytest.raises(ValueError, match="kimi_dapo.*already registered"):
        register_skyrl_losses(FakeRegistry)


def test_recipe_from_checkpoint_maps_k2x_settings(tmp_path):
    """A K2.5 INT4 config gives the recipe's QAT, LoRA-sync, text-only and loss overrides with the Kimi grid."""
    cfg = tiny_config("k25")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    topk = cfg["text_config"]["num_experts_per_tok"]
    rec = K2xRecipe.from_checkpoint(str(tmp_path), bf16_base_path="/masters", lora_rank=4 * topk)
    o = dict(x.split("=", 1) for x in rec.overrides())
    assert o["trainer.policy.model.fake_int4_qat.enabled"] == "true"
    assert (o["trainer.policy.model.fake_int4_qat.scale_divisor"], o["trainer.policy.model.fake_int4_qat.q_min"]) == (
        "7.0",
        "-7",
    )
    assert o["trainer.policy.model.fake_int4_qat.bf16_base_path"] == "/masters"
    assert o["trainer.policy.megatron_config.lora_config.merge_lora"] == "false"
    assert o["trainer.policy.model.kimi.normalize_moe_lora"] == "true"
    assert o["trainer.policy.language_model_only"] == o["generator.inference_engine.language_model_only"] == "true"
    assert o["trainer.override_entrypoint"] == "kimi_rl_glue.skyrl.main"
    assert o["trainer.algorithm.policy_loss_type"] == "kimi_dapo"
    assert o["trainer.algorithm.off_policy_correction.tis_ratio_type"] == "token"
    assert o["trainer.policy.model.lora.target_modules"] == "['linear_proj','linear_fc1','linear_fc2']"
    assert rec.expert_lora_rank == 4 and rec.env()["VLLM_PLUGINS"] == "kimi"


def test_recipe_rejections_name_the_key(tmp_path):
    """Indivisible normalized rank, QAT without masters and a K3 checkpoint are refused with the SkyRL key named."""
    with pytest.raises(RecipeError, match="normalize_moe_lora"):
        K2xRecipe("m", bf16_base_path="/b", lora_rank=30, moe_router_topk=8).validate()
    with pytest.raises(RecipeError, match="bf16_base_path"):
        K2xRecipe("m", moe_router_topk=8).validate()
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("k3")))
    with pytest.raises(RecipeError, match="K3-family"):
        K2xRecipe.from_checkpoint(str(tmp_path))


def test_entrypoint_helpers():
    """The dispatch argument is stripped before parsing; reward shaping applies DAPO's overlong rule or is a no-op."""
    assert strip_override_arg(["a=1", "trainer.override_entrypoint=kimi_rl_glue.skyrl.main", "b=2"]) == ["a=1", "b=2"]
    assert shape_rewards([1.0, 1.0, 1.0], [5, 9, 11], 10, 4, 1.0) == pytest.approx([1.0, 0.25, 0.0])
    assert shape_rewards([1.0], [50], 10, 0, 1.0) == [1.0]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        shape_rewards([[0.0, 1.0]], [2], 10, 4, 1.0)
