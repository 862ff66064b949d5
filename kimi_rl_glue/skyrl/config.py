"""The config that ``kimi_rl_glue.skyrl.main`` parses: SkyRL's dataclasses extended by our keys.

SkyRL parses overrides strictly (``build_nested_dataclass`` rejects unknown keys; the ``+key=``
prefix is refused), so every key our recipes pass must be a field. Added here:

* ``trainer.algorithm.overlong_buffer_len`` (0 = off), ``overlong_buffer_penalty_factor``: DAPO's
  soft overlong punishment (SkyRL's DAPO example fields);
* ``trainer.policy.model.kimi.expert_weights``: ``int4`` (default; the trainer keeps the routed
  experts as the release's packed INT4 bytes, kimi_megatron_plugin W4A16, exactly the served grid,
  so ``fake_int4_qat`` stays off) or ``bf16`` (BF16 masters, from ``fake_int4_qat.bf16_base_path`` or
  dequantized from ``model.path`` at load; ``fake_int4_qat.enabled`` fake-quantizes them on the forward
  with its ``scale_divisor`` / ``q_min``, in kimi_megatron_plugin's experts);
* ``trainer.policy.model.kimi.normalize_moe_lora``: routed experts at LoRA rank ``rank // top_k``.

No ``from __future__ import annotations`` here: SkyRL recurses into a nested config only when the
field's ``type`` is the class itself, not a string. SkyRL is passed in (``skyrl.train.config``), so
the extension is built lazily (SkyRL needs Python >= 3.12) and testable against stand-ins.
"""

import dataclasses
from dataclasses import dataclass, field

__all__ = ["EXPERT_WEIGHTS", "KimiModelOptions", "build_config", "check_config"]

EXPERT_WEIGHTS = ("int4", "bf16")


@dataclass
class KimiModelOptions:
    """``trainer.policy.model.kimi``: how the Kimi plugins build the policy."""

    expert_weights: str = "int4"
    """``int4``: packed INT4 routed experts in the trainer (no BF16 copy, no fake-quant pass);
    ``bf16``: BF16 masters (from ``trainer.policy.model.fake_int4_qat.bf16_base_path`` if set, else dequantized
    from ``model.path`` at load), fake-quantized on the forward when ``fake_int4_qat.enabled``."""

    normalize_moe_lora: bool = False
    """Routed experts train at LoRA rank ``rank // top_k`` (capacity-normalised expert LoRA, seed 003)."""

    def __post_init__(self):
        if self.expert_weights not in EXPERT_WEIGHTS:
            raise ValueError(
                f"trainer.policy.model.kimi.expert_weights={self.expert_weights!r}; "
                f"expected one of {'|'.join(EXPERT_WEIGHTS)}"
            )


def build_config(skyrl_config):
    """Our ``SkyRLTrainConfig`` subclass, from SkyRL's config module (``skyrl.train.config``).

    Uses its ``AlgorithmConfig``, ``ModelConfig``, ``PolicyConfig``, ``TrainerConfig`` and
    ``make_config``; ``trainer.policy.model.path`` keeps SkyRL's default.
    """
    m = skyrl_config
    algorithm = dataclasses.make_dataclass(
        "KimiAlgorithmConfig",
        [("overlong_buffer_len", int, field(default=0)), ("overlong_buffer_penalty_factor", float, field(default=1.0))],
        bases=(m.AlgorithmConfig,),
    )
    model = dataclasses.make_dataclass(
        "KimiModelConfig", [("kimi", KimiModelOptions, field(default_factory=KimiModelOptions))], bases=(m.ModelConfig,)
    )
    default_path = m.PolicyConfig().model.path
    policy = dataclasses.make_dataclass(
        "KimiPolicyConfig",
        [("model", model, field(default_factory=lambda: model(path=default_path)))],
        bases=(m.PolicyConfig,),
    )
    trainer = dataclasses.make_dataclass(
        "KimiTrainerConfig",
        [("algorithm", algorithm, field(default_factory=algorithm)), ("policy", policy, field(default_factory=policy))],
        bases=(m.TrainerConfig,),
    )
    return m.make_config(trainer_cls=trainer)


def check_config(cfg) -> None:
    """Cross-field checks of our keys against SkyRL's; errors name both keys."""
    model = cfg.trainer.policy.model
    qat = model.fake_int4_qat
    if model.kimi.expert_weights == "int4" and qat.enabled:
        raise ValueError(
            "trainer.policy.model.kimi.expert_weights=int4 keeps the served INT4 experts in the trainer; "
            "set trainer.policy.model.fake_int4_qat.enabled=false (there is nothing to fake-quantize)"
        )
