"""Registration of our losses into SkyRL's ``PolicyLossRegistry`` and of our environments into skyrl_gym (idempotent,
lazy import).

SkyRL's registry (``skyrl/backends/skyrl_train/utils/ppo_utils.py``) raises on a duplicate name and,
when Ray is initialised, pushes each function to a named Ray actor so workers see it; functions
registered before ``ray.init`` reach the workers through ``sync_registries()`` (called by
``kimi_rl_glue.skyrl.main``).
"""

from __future__ import annotations

from collections.abc import Callable

from kimi_rl_glue.skyrl.losses import kimi_dapo_policy_loss, kimi_grpo_policy_loss

__all__ = ["SKYRL_LOSSES", "load_policy_loss_registry", "register_skyrl_envs", "register_skyrl_losses"]

SKYRL_LOSSES: dict[str, Callable] = {"kimi_dapo": kimi_dapo_policy_loss, "kimi_grpo": kimi_grpo_policy_loss}
INSTALL_HINT = (
    "SkyRL is not installed: pip install 'kimi-rl-plugins[skyrl]' on Python >= 3.12 "
    "(pin a SkyRL commit after NovaSky-AI/SkyRL#2064 for the Kimi K2.x recipe)"
)


def load_policy_loss_registry():
    """SkyRL's ``PolicyLossRegistry`` class; ImportError with the install line when SkyRL is missing."""
    try:
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return PolicyLossRegistry


def _same(a: Callable, b: Callable) -> bool:
    # Functions may come back from a Ray actor via cloudpickle: compare by qualified name.
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register_skyrl_losses(registry=None, losses: dict[str, Callable] | None = None) -> list[str]:
    """Register ``losses`` (default :data:`SKYRL_LOSSES`) into ``registry`` (default SkyRL's).

    :param registry: anything with SkyRL's classmethods ``register(name, fn)``, ``get(name)``,
        ``list_available()``.
    :returns: the names newly registered (empty on a repeat call).
    :raises ValueError: a name is already registered to a different function (both named).
    """
    registry = registry if registry is not None else load_policy_loss_registry()
    added = []
    available = set(registry.list_available())
    for name, fn in (losses or SKYRL_LOSSES).items():
        if name in available:
            have = registry.get(name)
            if not _same(have, fn):
                raise ValueError(
                    f"SkyRL policy loss {name!r} is already registered to "
                    f"{getattr(have, '__module__', '?')}.{getattr(have, '__qualname__', have)}, "
                    f"not {fn.__module__}.{fn.__qualname__}"
                )
            continue
        registry.register(name, fn)
        added.append(name)
    return added


def register_skyrl_envs() -> None:
    """Register our skyrl_gym environments (``kimi_token_set``) in this process; generators make environments by
    name, so this runs where SkyRL's generator runs."""
    from kimi_rl_glue.skyrl.token_set_env import register_token_set_env

    register_token_set_env()
