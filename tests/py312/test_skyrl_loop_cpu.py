"""SkyRL 0.4.0's trainer batch path, run on CPU through our ``KimiTrainer`` hooks and ``kimi_dapo`` loss.

The objects are SkyRL's own: our ``KimiTrainer`` (a ``RayPPOTrainer`` subclass from
``kimi_rl_glue.skyrl.main.build_classes``) built from our ``KimiConfig`` with the two Ray/CUDA
monitors off, SkyRL's ``WorkerDispatch`` over a one-rank policy group, and a hand-made
``GeneratorOutput`` (4 prompts x 4 samples). The batch goes the way ``RayPPOTrainer.train`` sends
it: ``postprocess_generator_output`` (our DAPO overlong shaping, then SkyRL's per-token rewards) ->
``convert_to_training_input`` -> ``compute_advantages_and_returns`` (GRPO) -> the per-mini-batch
loss-reduction scaling of ``_execute_training_step`` -> ``PolicyLossRegistry.get("kimi_dapo")`` on
each mini-batch, as SkyRL's Megatron worker calls it. Only the policy forward is not run: its
log-probs (``action_log_probs``) are given, as ``fwd_logprobs_values_reward`` would store them.

Oracles: the DAPO overlong formula, GRPO advantages, the token-mean scaling and the clipped
objective written out in float64 here; SkyRL's own ``dual_clip`` and ``regular`` losses.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from py312_lane import require

require("skyrl.train.trainer", "skyrl==0.4.0")
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
from utils import assert_close

from kimi_rl_glue.skyrl.main import build_classes
from kimi_rl_glue.skyrl.registry import SKYRL_LOSSES, register_skyrl_losses

PROMPTS, N = 4, 4  # prompts x samples per prompt
L_MAX, L_BUF, FACTOR = 16, 6, 0.5  # max_generate_length, overlong_buffer_len, penalty factor
EPS_LOW, EPS_HIGH, CLIP_C, TIS_CAP = 0.2, 0.28, 3.0, 2.0
MINI_BATCH_PROMPTS = 2  # two mini-batches of 8 responses
PAD = 0
# response lengths per prompt: below, at and inside the buffer (L_MAX - L_BUF, L_MAX], and one past L_MAX
LENGTHS = [[4, 10, 11, 16], [13, 7, 17, 12], [9, 15, 3, 10], [14, 6, 11, 8]]
OVERRIDES = [
    # the two monitors RayPPOTrainer.__init__ would start as Ray actors / GPU pollers
    "generator.inference_engine.enable_ray_prometheus_stats=false",
    "trainer.enable_ray_gpu_monitor=false",
    f"generator.n_samples_per_prompt={N}",
    f"generator.sampling_params.max_generate_length={L_MAX}",
    f"trainer.train_batch_size={PROMPTS}",
    f"trainer.policy_mini_batch_size={MINI_BATCH_PROMPTS}",
    "trainer.micro_train_batch_size_per_gpu=4",
    "trainer.algorithm.advantage_estimator=grpo",
    "trainer.algorithm.policy_loss_type=kimi_dapo",
    "trainer.algorithm.loss_reduction=token_mean",
    f"trainer.algorithm.eps_clip_low={EPS_LOW}",
    f"trainer.algorithm.eps_clip_high={EPS_HIGH}",
    f"trainer.algorithm.clip_ratio_c={CLIP_C}",
    "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
    f"trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high={TIS_CAP}",
    f"trainer.algorithm.overlong_buffer_len={L_BUF}",
    f"trainer.algorithm.overlong_buffer_penalty_factor={FACTOR}",
]


class _OneRankPolicy:
    """The one method ``WorkerDispatch.get_lcm_dp_size`` asks of a policy actor group: data-parallel size 1."""

    def get_dp_size(self) -> int:
        return 1


@pytest.fixture(scope="module")
def registered():
    """Our losses in SkyRL's process-global registry for this module, removed afterwards."""
    register_skyrl_losses()
    yield
    for name in SKYRL_LOSSES:
        if name in PolicyLossRegistry.list_available():
            PolicyLossRegistry.unregister(name)


@pytest.fixture(scope="module")
def trainer(registered):
    """Our ``KimiTrainer`` as SkyRL's ``BasePPOExp`` would build it, minus the generator, engines and tracker."""
    KimiConfig, KimiTrainer, _ = build_classes()
    cfg = KimiConfig.from_cli_overrides(OVERRIDES)
    t = KimiTrainer(
        cfg=cfg,
        tracker=None,
        tokenizer=SimpleNamespace(pad_token_id=PAD),
        train_dataset=None,
        inference_engine_client=None,
        generator=None,
    )
    t.dispatch = WorkerDispatch(cfg, policy_actor_group=_OneRankPolicy())
    return t


def _generator_output(seed: int = 0):
    """A ``GeneratorOutput`` of ``PROMPTS x N`` responses (lengths from ``LENGTHS``) and its uids."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, rewards, masks, logprobs, uids = [], [], [], [], [], []
    for p in range(PROMPTS):
        prompt = torch.randint(1, 100, (3 + p,), generator=g).tolist()
        for n in LENGTHS[p]:
            prompts.append(prompt)
            responses.append(torch.randint(1, 100, (n,), generator=g).tolist())
            rewards.append(float(torch.rand((), generator=g) > 0.4) + 0.25 * float(torch.rand((), generator=g)))
            mask = (torch.rand(n, generator=g) > 0.15).long()
            mask[-1] = 1
            masks.append(mask.tolist())
            logprobs.append((-2.5 * torch.rand(n, generator=g)).tolist())
            uids.append(f"prompt-{p}")
    out = {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": masks,
        "stop_reasons": ["stop"] * len(responses),
        "rollout_metrics": None,
        "rollout_logprobs": logprobs,
    }
    return out, uids


def _dapo_overlong_f64(reward: float, length: int) -> float:
    """DAPO eq. 13: unchanged up to ``L_MAX - L_BUF``, minus a linear ramp in the buffer, 0 past ``L_MAX``."""
    if length > L_MAX:
        return 0.0
    start = L_MAX - L_BUF
    return reward - (FACTOR * (length - start) / L_BUF if length > start else 0.0)


def _right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """``[B, width]`` float64 with each row in its last ``len(row)`` columns (SkyRL's response layout)."""
    t = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        t[i, width - len(r) :] = torch.tensor(r, dtype=torch.float64)
    return t


def _grpo_f64(scores: list[float], uids: list[str]) -> torch.Tensor:
    """``[B]`` float64 GRPO advantages: (score - group mean) / (unbiased group std + 1e-6)."""
    out = torch.zeros(len(scores), dtype=torch.float64)
    for u in dict.fromkeys(uids):
        idx = [i for i, x in enumerate(uids) if x == u]
        s = [scores[i] for i in idx]
        mean = sum(s) / len(s)
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
        for i in idx:
            out[i] = (scores[i] - mean) / (std + 1e-6)
    return out


def _dapo_objective_f64(lp, old, adv, mask, roll) -> float:
    """Masked sum of DAPO's token loss in float64: clip-higher, dual-clip for A < 0, token TIS weight."""
    lp, old, adv, mask, roll = (t.detach().double() for t in (lp, old, adv, mask, roll))
    r = torch.exp(lp - old)
    loss = torch.maximum(-r * adv, -r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    loss = torch.where(adv < 0, torch.minimum(loss, -CLIP_C * adv), loss)
    w = torch.exp(old - roll).clamp(max=TIS_CAP)
    return float((loss * w * mask).sum())


def _run_batch(trainer, seed: int = 0):
    """One step's batch through the trainer, as ``RayPPOTrainer.train`` runs it; returns what each stage saw."""
    gen, uids = _generator_output(seed)
    raw = list(gen["rewards"])
    lengths = [len(r) for r in gen["response_ids"]]
    out, uids = trainer.postprocess_generator_output(gen, uids)
    batch = trainer.convert_to_training_input(out, uids)
    # what fwd_logprobs_values_reward stores without critic and ref: the policy's log-probs at the
    # sampled tokens (here the rollout's, moved a little, standing in for the trainer-side forward)
    g = torch.Generator().manual_seed(seed + 1)
    roll = batch["rollout_logprobs"]
    old = (roll + 0.05 * torch.randn(roll.shape, generator=g)) * batch["response_mask"]
    batch["action_log_probs"] = old
    batch["base_action_log_probs"] = None
    batch["values"] = None
    batch = trainer.compute_advantages_and_returns(batch)
    adv_raw = batch["advantages"].clone()
    boundaries = batch.metadata["policy_mini_batch_boundaries"]
    batch = trainer._normalize_advantages(batch, boundaries, batch.metadata.get("policy_prompt_boundaries"))
    return SimpleNamespace(
        raw=raw, lengths=lengths, uids=uids, out=out, batch=batch, adv_raw=adv_raw, boundaries=boundaries, old=old
    )


def test_trainer_builds_without_ray_or_cuda(trainer):
    """With the two monitors off, RayPPOTrainer.__init__ of our KimiTrainer starts no Ray actor and needs no CUDA."""
    import ray

    assert type(trainer).__name__ == "KimiTrainer" and type(trainer).__mro__[1].__name__ == "RayPPOTrainer"
    assert trainer._vllm_metrics_scraper is None and trainer._ray_gpu_monitor is None
    assert not ray.is_initialized()
    assert trainer.cfg.trainer.algorithm.overlong_buffer_len == L_BUF


def test_overlong_shaping_changes_exactly_the_overlong_rewards(trainer):
    """postprocess_generator_output: the last-token reward of each response is DAPO's shaped reward (float64
    formula); responses up to L_MAX - L_BUF keep their reward bit for bit; SkyRL's reward metric is the shaped mean."""
    run = _run_batch(trainer)
    shaped = [_dapo_overlong_f64(r, n) for r, n in zip(run.raw, run.lengths)]
    changed = 0
    for i, (tok_rewards, n) in enumerate(zip(run.out["rewards"], run.lengths)):
        assert len(tok_rewards) == n and all(x == 0.0 for x in tok_rewards[:-1])
        if n <= L_MAX - L_BUF:
            assert tok_rewards[-1] == run.raw[i], (i, n)
        else:
            changed += 1
            assert tok_rewards[-1] != run.raw[i] or run.raw[i] == 0.0
        assert tok_rewards[-1] == pytest.approx(shaped[i], abs=1e-12), (i, n, run.raw[i])
    assert changed == sum(n > L_MAX - L_BUF for n in run.lengths) >= 6
    assert trainer.all_metrics["reward/avg_raw_reward"] == pytest.approx(sum(shaped) / len(shaped), abs=1e-6)
    # the padded batch carries the shaped reward at each response's last (right-aligned) position
    assert torch.allclose(run.batch["rewards"][:, -1].double(), torch.tensor(shaped, dtype=torch.float64), atol=1e-6)


def test_grpo_advantages_and_minibatch_token_mean(trainer):
    """compute_advantages_and_returns gives GRPO's advantages of the shaped rewards on the response tokens; the
    mini-batch reduction of _execute_training_step divides them by the mini-batch's loss-token count (float64)."""
    run = _run_batch(trainer)
    b = run.batch
    width = b["response_mask"].shape[1]
    assert b["sequences"].shape[0] == PROMPTS * N and width == max(run.lengths)
    resp_mask = _right_aligned([[1.0] * n for n in run.lengths], width)
    assert torch.equal(b["response_mask"].double(), resp_mask)
    loss_mask = _right_aligned([[float(x) for x in m] for m in run.out["loss_masks"]], width)
    assert torch.equal(b["loss_mask"].double(), loss_mask)
    shaped = [_dapo_overlong_f64(r, n) for r, n in zip(run.raw, run.lengths)]
    adv = _grpo_f64(shaped, run.uids)[:, None] * resp_mask
    assert_close("GRPO advantages vs float64", adv, run.adv_raw, 1e-6)
    assert run.boundaries == [(0, MINI_BATCH_PROMPTS * N), (MINI_BATCH_PROMPTS * N, PROMPTS * N)]
    scaled = adv.clone()
    for s, e in run.boundaries:
        scaled[s:e] /= loss_mask[s:e].sum()
    assert_close("token_mean scaled advantages vs float64", scaled, b["advantages"], 1e-6)


def test_kimi_dapo_on_the_batch_equals_float64_and_skyrl_dual_clip(trainer):
    """kimi_dapo, looked up in SkyRL's registry and called per mini-batch as SkyRL's worker calls it, equals the
    float64 DAPO objective (clip-higher, dual-clip, token TIS) and SkyRL's own dual_clip loss (value and gradient)."""
    run = _run_batch(trainer)
    b, alg = run.batch, trainer.cfg.trainer.algorithm
    assert alg.policy_loss_type == "kimi_dapo"
    ours = PolicyLossRegistry.get(alg.policy_loss_type)
    theirs = PolicyLossRegistry.get("dual_clip")
    as_dual_clip = dataclasses.replace(alg, policy_loss_type="dual_clip")  # SkyRL's loss checks the name
    g = torch.Generator().manual_seed(7)
    clipped = dual = 0.0
    for s, e in run.boundaries:
        mb = b[s:e]
        old, adv, mask, roll = mb["action_log_probs"], mb["advantages"], mb["loss_mask"], mb["rollout_logprobs"]
        # the current policy, moved far enough from `old` that both clip sides and the dual clip act
        lp = (old + 0.6 * torch.randn(old.shape, generator=g)).requires_grad_(True)
        got, metrics = ours(lp, old, adv, config=alg, loss_mask=mask, rollout_logprobs=roll)
        (g_got,) = torch.autograd.grad(got, lp)
        f64 = _dapo_objective_f64(lp, old, adv, mask, roll)
        assert abs(got.item() - f64) <= 1e-5 * max(1.0, abs(f64)), (s, got.item(), f64)
        ref, ref_metrics = theirs(lp, old, adv, config=as_dual_clip, loss_mask=mask, rollout_logprobs=roll)
        (g_ref,) = torch.autograd.grad(ref, lp)
        assert_close(f"kimi_dapo vs skyrl dual_clip [{s}:{e}]", ref, got, 1e-6)
        assert_close(f"kimi_dapo grad vs skyrl dual_clip [{s}:{e}]", g_ref, g_got, 1e-6)
        assert metrics["clip_ratio"] == pytest.approx(ref_metrics["clip_ratio"], abs=1e-7)
        clipped += metrics["clip_ratio"]
        dual += metrics.get("dual_clip_ratio", 0.0)
    assert clipped > 0 and dual > 0, f"the test inputs must make both clips act ({clipped}, {dual})"


def test_kimi_dapo_at_ratio_one_equals_skyrl_regular(trainer):
    """On policy (log_probs == old_log_probs, no clip active), kimi_dapo equals SkyRL's regular PPO loss and the
    float64 sum of -w * A over loss tokens."""
    run = _run_batch(trainer)
    b, alg = run.batch, trainer.cfg.trainer.algorithm
    old, adv, mask, roll = b["action_log_probs"], b["advantages"], b["loss_mask"], b["rollout_logprobs"]
    lp = old.clone().requires_grad_(True)
    got, metrics = PolicyLossRegistry.get("kimi_dapo")(lp, old, adv, alg, loss_mask=mask, rollout_logprobs=roll)
    as_regular = dataclasses.replace(alg, policy_loss_type="regular")
    ref, _ = PolicyLossRegistry.get("regular")(lp, old, adv, as_regular, loss_mask=mask, rollout_logprobs=roll)
    assert metrics["clip_ratio"] == 0.0
    assert_close("kimi_dapo vs skyrl regular at ratio 1", ref, got, 1e-6)
    w = torch.exp(old.double() - roll.double()).clamp(max=TIS_CAP)
    f64 = float((-w * adv.double() * mask.double()).sum())
    assert abs(got.item() - f64) <= 1e-5 * max(1.0, abs(f64)), (got.item(), f64)


def test_without_overlong_buffer_kimi_trainer_equals_skyrl_trainer(registered):
    """With overlong_buffer_len = 0, our trainer's batch (rewards, advantages, metrics) is SkyRL's own
    RayPPOTrainer's, tensor for tensor: the hook adds nothing else."""
    from skyrl.train.trainer import RayPPOTrainer

    KimiConfig, KimiTrainer, _ = build_classes()
    overrides = [o for o in OVERRIDES if not o.startswith("trainer.algorithm.overlong_")]
    runs = []
    for cls in (KimiTrainer, RayPPOTrainer):
        cfg = KimiConfig.from_cli_overrides(overrides)
        assert cfg.trainer.algorithm.overlong_buffer_len == 0
        t = cls(
            cfg=cfg,
            tracker=None,
            tokenizer=SimpleNamespace(pad_token_id=PAD),
            train_dataset=None,
            inference_engine_client=None,
            generator=None,
        )
        t.dispatch = WorkerDispatch(cfg, policy_actor_group=_OneRankPolicy())
        runs.append((_run_batch(t), t.all_metrics))
    (ours, ours_m), (theirs, theirs_m) = runs
    assert ours.out["rewards"] == theirs.out["rewards"]
    for key in ("sequences", "loss_mask", "rewards", "advantages"):
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert ours_m == theirs_m


def test_fully_async_metrics_output_is_shaped_too(trainer):
    """The fully-async trainer passes a kept + dropped superset as metrics_generator_output: it is shaped as well,
    so SkyRL's reward metrics are over the trained (shaped) rewards of the whole superset."""
    gen, uids = _generator_output(seed=3)
    extra, extra_uids = _generator_output(seed=4)
    superset = {k: (gen[k] + extra[k]) if isinstance(gen[k], list) else gen[k] for k in gen}
    lengths = [len(r) for r in superset["response_ids"]]
    shaped = [_dapo_overlong_f64(r, n) for r, n in zip(superset["rewards"], lengths)]
    trainer.postprocess_generator_output(
        gen, uids, metrics_generator_output=superset, metrics_uids=uids + [f"x-{u}" for u in extra_uids]
    )
    assert superset["rewards"] == pytest.approx(shaped, abs=1e-12)
    assert trainer.all_metrics["reward/avg_raw_reward"] == pytest.approx(sum(shaped) / len(shaped), abs=1e-6)
