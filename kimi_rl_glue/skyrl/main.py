"""``trainer.override_entrypoint=kimi_rl_glue.skyrl.main``: SkyRL's PPO loop with our losses and DAPO shaping.

SkyRL's ``main_base.main()`` imports this module and calls :func:`main` before its strict config
parse (``NovaSky-AI/SkyRL:skyrl/train/entrypoints/main_base.py``). We then:

1. drop the ``trainer.override_entrypoint=`` argument (not a field of our config) and parse the rest
   with SkyRL's config extended by :mod:`kimi_rl_glue.skyrl.config` (``trainer.algorithm.overlong_*``,
   ``trainer.policy.model.kimi.expert_weights``), then check our keys against SkyRL's;
2. register ``kimi_dapo`` / ``kimi_grpo`` in ``PolicyLossRegistry`` (before ``validate_cfg``, which
   checks ``policy_loss_type`` against the registry), start Ray and sync the registries to it;
3. run ``BasePPOExp`` with a trainer that applies DAPO's soft overlong punishment
   (``kimi_rl_glue.losses.overlong``) to the rewards before advantages are computed and, with
   ``trainer.strategy=megatron``, builds its policy with ``kimi_rl_glue.skyrl.worker`` (the Kimi model,
   LoRA and adapter sync inside SkyRL's Megatron worker);
4. register our skyrl_gym environments (``kimi_token_set``) in the process that runs the generator.
"""

from __future__ import annotations

import json
import os
import sys

from kimi_rl_glue.losses.overlong import apply_overlong_penalty

__all__ = ["main", "build_classes", "strip_override_arg", "shape_rewards", "save_rollouts", "STEP0_DUMP_ENV"]

OVERRIDE_PREFIX = "trainer.override_entrypoint="

#: environment variable naming a JSON file: the first batch of rollouts (token ids and the engine's logprobs)
#: is written there, for an offline comparison with ``kimi_core.reference`` on the same tokens
STEP0_DUMP_ENV = "KIMI_SKYRL_DUMP_ROLLOUTS"


def strip_override_arg(argv: list[str]) -> list[str]:
    """``argv`` without the ``trainer.override_entrypoint=...`` dispatch argument."""
    return [a for a in argv if not a.startswith(OVERRIDE_PREFIX)]


def shape_rewards(
    rewards: list, response_lengths: list[int], max_generate_length: int, buffer_len: int, penalty_factor: float
) -> list:
    """DAPO soft overlong punishment on SkyRL's per-response scalar rewards (unchanged if ``buffer_len`` is 0).

    :raises ValueError: token-level (list) rewards, which the punishment is not defined for.
    """
    if buffer_len <= 0:
        return rewards
    if any(isinstance(r, (list, tuple)) for r in rewards):
        raise ValueError(
            "trainer.algorithm.overlong_buffer_len > 0 needs one scalar reward per response; "
            "the generator returned token-level rewards"
        )
    return apply_overlong_penalty(rewards, response_lengths, max_generate_length, buffer_len, penalty_factor).tolist()


def save_rollouts(generator_output, path: str) -> None:
    """Write a ``GeneratorOutput``'s ``prompt_token_ids``, ``response_ids``, ``rollout_logprobs`` and ``rewards``
    as JSON (atomically)."""
    keys = ("prompt_token_ids", "response_ids", "rollout_logprobs", "rewards")
    data = {k: generator_output.get(k) for k in keys}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def build_classes():
    """``(KimiConfig, KimiTrainer, KimiExp)``: our config, trainer and experiment subclasses of SkyRL's.

    Imported lazily (SkyRL needs Python >= 3.12).
    """
    import torch

    from kimi_rl_glue.skyrl.config import build_config
    from kimi_rl_glue.skyrl.registry import INSTALL_HINT

    try:
        import skyrl.train.config as skyrl_config
        from skyrl.train.entrypoints.main_base import BasePPOExp
        from skyrl.train.trainer import RayPPOTrainer
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e

    KimiConfig = build_config(skyrl_config)

    class KimiTrainer(RayPPOTrainer):
        @torch.no_grad()
        def postprocess_generator_output(
            self, generator_output, uids, metrics_generator_output=None, metrics_uids=None
        ):
            # skyrl 0.4.0 signature: the fully-async trainer passes a kept+dropped superset for metrics
            # by keyword; it gets the same shaping so the reported rewards are the trained ones
            alg = self.cfg.trainer.algorithm
            outs = [generator_output]
            if metrics_generator_output is not None and metrics_generator_output is not generator_output:
                outs.append(metrics_generator_output)
            if alg.overlong_buffer_len > 0:
                for out in outs:
                    out["rewards"] = shape_rewards(
                        out["rewards"],
                        [len(r) for r in out["response_ids"]],
                        self.cfg.generator.sampling_params.max_generate_length,
                        alg.overlong_buffer_len,
                        alg.overlong_buffer_penalty_factor,
                    )
            dump = os.environ.get(STEP0_DUMP_ENV)
            if dump and not os.path.exists(dump):
                save_rollouts(generator_output, dump)
            return super().postprocess_generator_output(generator_output, uids, metrics_generator_output, metrics_uids)

        def build_models(self, PolicyWorker, CriticWorker, RefWorker):
            # the Megatron policy builds the Kimi model, LoRA and adapter sync (kimi_rl_glue.skyrl.worker)
            if self.cfg.trainer.strategy == "megatron":
                import ray

                from kimi_rl_glue.skyrl.worker import build_policy_worker

                alg = self.cfg.trainer.algorithm
                if alg.use_kl_loss or alg.use_kl_in_reward:
                    raise ValueError(
                        "trainer.algorithm.use_kl_loss / use_kl_in_reward need a reference model, which the Kimi "
                        "Megatron worker does not build yet; set both to false"
                    )
                PolicyWorker = ray.remote(num_gpus=1)(build_policy_worker())
            return super().build_models(PolicyWorker, CriticWorker, RefWorker)

    class KimiExp(BasePPOExp):
        def get_trainer(self, *args, **kwargs):
            return KimiTrainer(*args, **kwargs)

    return KimiConfig, KimiTrainer, KimiExp


def _build():
    """Config class and the Ray entry task running :func:`build_classes`' experiment."""
    import ray

    KimiConfig, _, KimiExp = build_classes()

    @ray.remote(num_cpus=1)
    def entry(cfg):
        # Workers are fresh processes: register again so the registry is complete there too.
        from kimi_rl_glue.skyrl.registry import register_skyrl_envs, register_skyrl_losses

        register_skyrl_losses()
        register_skyrl_envs()
        if cfg.trainer.strategy == "megatron":  # SkyRL imports its Megatron worker (and so Bridge) here
            from kimi_megatron_plugin.patches import te_stub

            te_stub.install()
        KimiExp(cfg).run()

    return KimiConfig, entry


def main(argv: list[str] | None = None) -> None:
    """Entry point named by ``trainer.override_entrypoint``; reads ``sys.argv[1:]`` by default."""
    import ray

    from kimi_rl_glue.skyrl.registry import register_skyrl_losses

    KimiConfig, entry = _build()
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries
    from skyrl.train.utils import initialize_ray, validate_cfg

    from kimi_rl_glue.skyrl.config import check_config

    cfg = KimiConfig.from_cli_overrides(strip_override_arg(list(sys.argv[1:] if argv is None else argv)))
    check_config(cfg)
    register_skyrl_losses()
    validate_cfg(cfg)
    initialize_ray(cfg)
    sync_registries()
    ray.get(entry.remote(cfg))


if __name__ == "__main__":
    main()
