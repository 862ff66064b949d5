"""Our SkyRL config extension (kimi_rl_glue/skyrl/config.py): the keys the SkyRL example passes are fields.

SkyRL itself needs Python >= 3.12; here the extension is built on small stand-ins with SkyRL's shape
(ModelConfig/PolicyConfig/TrainerConfig/AlgorithmConfig, make_config) and parsed by a strict builder
that, like SkyRL's, rejects unknown keys and recurses only into fields typed by a dataclass class.
The real SkyRL parser takes the same overrides in tests/py312/test_skyrl_config.py (Python 3.12 lane).
"""

import dataclasses
import types
from dataclasses import dataclass, field

import pytest
from utils import skyrl_dry_run_overrides

from kimi_rl_glue.skyrl.config import KimiModelOptions, build_config, check_config
from kimi_rl_glue.skyrl.main import strip_override_arg


# ---- stand-ins with SkyRL's shape (not its code) -------------------------------------------------
@dataclass
class _Qat:
    enabled: bool = False
    bf16_base_path: str | None = None


@dataclass
class _Model:
    path: str | None = None
    fake_int4_qat: _Qat = field(default_factory=_Qat)


@dataclass
class _Policy:
    model: _Model = field(default_factory=lambda: _Model(path="default/model"))
    language_model_only: bool = False


@dataclass
class _Algorithm:
    eps_clip_high: float = 0.2


@dataclass
class _Trainer:
    algorithm: _Algorithm = field(default_factory=_Algorithm)
    policy: _Policy = field(default_factory=_Policy)


@dataclass
class _Root:
    trainer: _Trainer = field(default_factory=_Trainer)


def _make_config(trainer_cls):
    return dataclasses.make_dataclass(
        "_Custom", [("trainer", trainer_cls, field(default_factory=trainer_cls))], bases=(_Root,)
    )


SKYRL_LIKE = types.SimpleNamespace(
    AlgorithmConfig=_Algorithm,
    ModelConfig=_Model,
    PolicyConfig=_Policy,
    TrainerConfig=_Trainer,
    make_config=_make_config,
)


def _scalar(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v


def _strict_build(cls, d: dict):
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(names)
    if unknown:
        raise ValueError(f"Invalid fields {unknown} for {cls.__name__}")
    kw = {}
    for k, v in d.items():
        t = names[k].type
        kw[k] = _strict_build(t, v) if isinstance(v, dict) and dataclasses.is_dataclass(t) else v
    return cls(**kw)


def _parse(cls, overrides: list[str]):
    tree: dict = {}
    for o in overrides:
        key, _, value = o.partition("=")
        node = tree
        *path, leaf = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = _scalar(value)
    return _strict_build(cls, tree)


OURS = (
    "trainer.policy.model.kimi.",
    "trainer.policy.model.fake_int4_qat.enabled",
    "trainer.policy.model.fake_int4_qat.bf16_base_path",
    "trainer.algorithm.overlong_",
)


# ---- tests -----------------------------------------------------------------------------------------
def test_fields_are_real_classes_with_skyrl_default_path():
    cfg_cls = build_config(SKYRL_LIKE)
    trainer = {f.name: f.type for f in dataclasses.fields(cfg_cls)}["trainer"]
    policy = {f.name: f.type for f in dataclasses.fields(trainer)}["policy"]
    model = {f.name: f.type for f in dataclasses.fields(policy)}["model"]
    assert {f.name: f.type for f in dataclasses.fields(model)}["kimi"] is KimiModelOptions
    cfg = cfg_cls()
    assert cfg.trainer.policy.model.path == "default/model" and cfg.trainer.policy.model.kimi.expert_weights == "int4"
    assert cfg.trainer.algorithm.overlong_buffer_len == 0 and cfg.trainer.algorithm.eps_clip_high == 0.2


@pytest.mark.parametrize("knobs", [{}, {"EXPERT_WEIGHTS": "bf16"}, {"EXPERT_WEIGHTS": "bf16", "QAT_MODE": "off"}])
def test_example_script_overrides_are_accepted(knobs):
    """Our keys from the example's DRY_RUN command parse strictly and pass the cross-field check."""
    mine = [o for o in strip_override_arg(skyrl_dry_run_overrides(**knobs)) if o.startswith(OURS)]
    assert any(o.startswith("trainer.policy.model.kimi.expert_weights=") for o in mine)
    cfg = _parse(build_config(SKYRL_LIKE), mine)
    assert cfg.trainer.policy.model.kimi.expert_weights == knobs.get("EXPERT_WEIGHTS", "int4")
    check_config(cfg)


def test_bad_values_are_named():
    cls = build_config(SKYRL_LIKE)
    with pytest.raises(ValueError, match=r"trainer.policy.model.kimi.expert_weights='fp8'; expected one of int4\|bf16"):
        _parse(cls, ["trainer.policy.model.kimi.expert_weights=fp8"])
    with pytest.raises(ValueError, match="Invalid fields"):
        _parse(cls, ["trainer.policy.model.kimi.expert_weight=int4"])
    with pytest.raises(ValueError, match="fake_int4_qat.enabled=false"):
        check_config(_parse(cls, ["trainer.policy.model.fake_int4_qat.enabled=true"]))
    # BF16 masters without bf16_base_path: dequantized from model.path at load by our bridge
    check_config(_parse(cls, ["trainer.policy.model.kimi.expert_weights=bf16"]))
