"""``kimi_token_set``: the demo's token-set reward as a skyrl_gym environment.

Runs against the real skyrl_gym where it is installed (``.venv-py312``: skyrl 0.4.0 brings skyrl-gym); the main
lane's ``.venv`` has none, so there a stand-in with skyrl_gym's interface (``BaseTextEnv``, ``register``,
``registry``, ``make`` by ``"module:Class"`` entry point) takes its place for the duration of each test.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from kimi_core.checkpoint.tokenizer import FIRST_WORD_ID
from kimi_rl_glue.demo.task import TokenSetTask

MODULE = "kimi_rl_glue.skyrl.token_set_env"


def _stand_in() -> dict[str, types.ModuleType]:
    """Modules ``skyrl_gym``, ``.envs``, ``.envs.base_text_env``, ``.envs.registration`` with the used interface."""
    root, envs = types.ModuleType("skyrl_gym"), types.ModuleType("skyrl_gym.envs")
    base, reg = types.ModuleType("skyrl_gym.envs.base_text_env"), types.ModuleType("skyrl_gym.envs.registration")

    class BaseTextEnv:
        def __init__(self):
            self.turns, self.max_turns = 0, 1

    base.BaseTextEnv, base.BaseTextEnvStepOutput = BaseTextEnv, dict
    reg.registry = {}

    def register(id, entry_point=None, kwargs=None):
        if id in reg.registry:
            raise RuntimeError(f"An environment with name `{id}` is already registered")
        reg.registry[id] = types.SimpleNamespace(id=id, entry_point=entry_point, kwargs=kwargs or {})

    def make(id, **kwargs):
        ep = reg.registry[id].entry_point
        mod, _, attr = ep.partition(":")
        return getattr(importlib.import_module(mod), attr)(**kwargs)

    reg.register, reg.make = register, make
    root.envs, root.make, root.register, root.registry = envs, make, register, reg.registry
    envs.base_text_env, envs.registration = base, reg
    return {m.__name__: m for m in (root, envs, base, reg)}


@pytest.fixture
def env_mod(monkeypatch):
    """The module under test, imported against the real skyrl_gym or the stand-in; the registry entry is restored."""
    try:
        import skyrl_gym  # noqa: F401 (only whether it is installed)
    except ImportError:
        for name, mod in _stand_in().items():
            monkeypatch.setitem(sys.modules, name, mod)
    sys.modules.pop(MODULE, None)
    mod = importlib.import_module(MODULE)
    from skyrl_gym.envs.registration import registry

    monkeypatch.delitem(registry, mod.ENV_ID, raising=False)
    yield mod
    sys.modules.pop(MODULE, None)


def _extras(ground_truth: str) -> dict:
    """What SkyRL's dataset passes: every column but prompt and env_class, plus the generator's max_turns."""
    return {"reward_model": {"ground_truth": ground_truth}, "data_source": "kimi_token_set", "max_turns": 1}


def test_reward_is_the_fraction_of_target_words(env_mod):
    """3 of 6 words are targets: reward 0.5, done after one step; special tokens and unknown words are misses."""
    env = env_mod.TokenSetEnv(env_config={}, extras=_extras("w10 w11 w500"))
    out = env.step(" w10 w12 w11 w10 foo </s>")
    assert out["reward"] == 0.5
    assert out["done"] is True
    assert out["observations"] == []
    assert out["metadata"] == {"words": 6, "hits": 3}
    assert env.step("w500 w11")["reward"] == 1.0
    assert env.step("w7\nw8\tw9 w11")["reward"] == 0.25


@pytest.mark.parametrize("action", ["", "   ", "\n"], ids=["empty", "spaces", "newline"])
def test_empty_response_scores_zero(env_mod, action):
    """A response with no words gets reward 0.0, not a division error."""
    out = env_mod.TokenSetEnv(extras=_extras("w10")).step(action)
    assert (out["reward"], out["done"], out["metadata"]) == (0.0, True, {"words": 0, "hits": 0})


@pytest.mark.parametrize(
    "extras, named",
    [
        pytest.param({}, "reward_model.ground_truth", id="no-reward-model"),
        pytest.param({"reward_model": {}}, "reward_model.ground_truth", id="no-ground-truth"),
        pytest.param(_extras(""), "non-empty string", id="empty-ground-truth"),
        pytest.param(_extras("w10 x7"), "'x7'", id="not-a-word"),
        pytest.param(_extras("w2"), "'w2'", id="special-id"),
    ],
)
def test_bad_ground_truth_is_refused(env_mod, extras, named):
    """A row without target words, or with a word the tokenizer does not have, is refused with the field named."""
    with pytest.raises(ValueError, match="kimi_token_set") as e:
        env_mod.TokenSetEnv(extras=extras)
    assert named in str(e.value)


def test_reward_matches_the_demo_task(env_mod):
    """For the demo task's target set, the environment scores the words of a response as TokenSetTask scores its
    ids, and both equal the count recomputed here."""
    task = TokenSetTask(1024, seed=3, n_targets=16, first_id=FIRST_WORD_ID)
    targets = sorted(task.targets)
    others = task.others[:5].tolist()
    response = [targets[0], others[0], targets[1], others[1], others[2], targets[0], others[3]]
    env = env_mod.TokenSetEnv(extras=_extras(" ".join(f"w{i}" for i in targets)))
    got = env.step(" ".join(f"w{i}" for i in response))["reward"]
    assert got == task.reward(response) == 3 / 7


def test_registration_is_idempotent_and_make_builds_the_env(env_mod):
    """register_token_set_env twice registers once; skyrl_gym.make builds the env by id, as SkyRL's generator does."""
    import skyrl_gym
    from skyrl_gym.envs.registration import registry

    env_mod.register_token_set_env()
    env_mod.register_token_set_env()
    assert registry[env_mod.ENV_ID].entry_point == "kimi_rl_glue.skyrl.token_set_env:TokenSetEnv"
    env = skyrl_gym.make("kimi_token_set", env_config={}, extras=_extras("w10 w11"))
    assert type(env).__name__ == "TokenSetEnv"
    assert env.step("w10 w9")["reward"] == 0.5


def test_registration_refuses_a_foreign_env_under_the_id(env_mod):
    """An id already taken by another entry point is an error naming it, not a silent keep or overwrite."""
    from skyrl_gym.envs.registration import register

    register(id=env_mod.ENV_ID, entry_point="somewhere.else:Env")
    with pytest.raises(ValueError, match="somewhere.else:Env"):
        env_mod.register_token_set_env()
