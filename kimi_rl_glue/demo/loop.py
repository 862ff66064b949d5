"""The demo's RL loop: rollout -> reward -> advantages -> loss -> optimizer step -> adapter sync.

Per step: ``prompts`` prompts x ``group`` samples of ``max_tokens`` tokens from the vLLM engine
(with the current adapter), rewards from :class:`~.task.TokenSetTask`, GRPO group advantages,
the loss (score centering by default, GRPO + token TIS by flag) on the trainer's logits, one
optimizer step, then adapter-only sync (publish checksummed buckets, verify, hot-load under a
fresh versioned name). Metrics per step go to ``metrics.jsonl`` under miles' names (``rollout/raw_reward``,
``train/train_rollout_logprob_abs_diff``, ``train/train_rollout_kl``, ``train/grad_norm``; seconds per stage as
``perf/rollout_s``, ``perf/train_s``, ``perf/sync_s``); ``reward.png`` at the end.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kimi_core.errors import AdapterRejected, KimiError
from kimi_rl_glue.losses import (
    dynamic_sampling_keep,
    group_advantages,
    mismatch_metrics,
    policy_loss,
    score_centering_from_logits,
)
from kimi_rl_glue.sync import AdapterSyncError

log = logging.getLogger(__name__)


class DemoError(KimiError, RuntimeError):
    """The RL loop stopped: the rollout engine failed or an adapter version was rejected.

    The message names the step and the adapter the engine still serves (the last good one).
    """


@dataclass
class LoopConfig:
    steps: int = 30
    prompts: int = 8
    group: int = 4
    max_tokens: int = 8
    loss: str = "score_centering"  # or "grpo_tis"
    importance: str = "tis"  # score centering's importance function: none | tis | mis
    seed: int = 0
    #: DAPO dynamic sampling (grpo_tis): groups whose rewards are all equal are masked out of the loss
    #: (no refill: the batch shrinks; ``train/dynamic_sampling_kept`` is the fraction of samples kept)
    dynamic_sampling: bool = False


def batch_tensors(samples, topk: int):
    """Stack samples of equal lengths: ``ids [N, P+M]``, ``tokens [N, M]``, rollout ``lp [N, M]``,
    ``topk_ids``/``topk_lp`` ``[N, M, K]``, ``groups [N]``."""
    ids = torch.tensor([s.prompt + s.tokens for s in samples])
    tokens = torch.tensor([s.tokens for s in samples])
    lp = torch.stack([s.logprobs for s in samples])
    tids = torch.stack([s.topk_ids for s in samples])
    tlp = torch.stack([s.topk_logprobs for s in samples])
    return ids, tokens, lp, tids, tlp, torch.tensor([s.group for s in samples])


def train_step(trainer, samples, rewards: torch.Tensor, cfg: LoopConfig, topk: int) -> dict:
    """One optimizer step on ``samples`` (replaying the engine's routing when the samples carry it); returns the
    step's loss and mismatch metrics under miles' names
    (``train/loss``, ``train/grad_norm``, ``train/train_rollout_logprob_abs_diff``, ``train/train_rollout_kl``,
    ``train/<loss metric>``)."""
    ids, tokens, rollout_lp, tids, tlp, groups = batch_tensors(samples, topk)
    adv = group_advantages(rewards, groups, norm_by_std=True).float()
    M = tokens.shape[1]
    # R3: where the engine returned its routing, the trainer replays it (``[N, P + M - 1, layers, k]``)
    routed = torch.tensor([s.routed for s in samples]) if all(s.routed is not None for s in samples) else None
    logits = trainer.logits(ids[:, :-1], routed_experts=routed)[:, -M:]  # positions predicting the response tokens
    dev = logits.device  # the trainer's (rollout tensors come from the engine on the CPU)
    tokens, rollout_lp, tids, tlp = tokens.to(dev), rollout_lp.to(dev), tids.to(dev), tlp.to(dev)
    adv_t = adv.to(dev)[:, None].expand_as(tokens)
    if cfg.loss == "score_centering":
        loss_t, sc_metrics, lp = score_centering_from_logits(
            logits, tokens, tids, rollout_lp, tlp, adv_t, importance=cfg.importance
        )
        loss = loss_t.mean()
        extra = {k: float(v.float().mean()) for k, v in sc_metrics.items()}
    elif cfg.loss == "grpo_tis":
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
        mask = None
        if cfg.dynamic_sampling:
            keep = dynamic_sampling_keep(rewards, groups)
            mask = keep.to(dev)[:, None].expand_as(tokens).float()
        loss, extra = policy_loss(lp, lp.detach(), adv_t, mask, rollout_lp, tis_type="token")
        if cfg.dynamic_sampling:
            extra["dynamic_sampling_kept"] = float(keep.float().mean())
    else:
        raise ValueError(f"--loss {cfg.loss!r}: expected score_centering or grpo_tis")
    mm = mismatch_metrics(lp.detach(), rollout_lp)
    gn = trainer.step(loss)
    return {
        "train/loss": float(loss.detach()),
        "train/grad_norm": gn,
        **{f"train/{k}": v for k, v in mm.items()},
        **{f"train/{k}": v for k, v in extra.items()},
    }


def run(cfg: LoopConfig, task, rollout, trainer, sync, out: str, progress: bool = True, bar_file=None) -> list[dict]:
    """Run ``cfg.steps`` RL steps; write ``metrics.jsonl`` in ``out`` and return the per-step records.

    :param bar_file: where the one progress bar goes (default ``sys.stderr``; the demo passes its terminal while
        the hosts' output goes to its log file)."""
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(cfg.seed)
    records = []
    mpath = os.path.join(out, "metrics.jsonl")
    open(mpath, "w").close()
    bar = tqdm(range(cfg.steps), desc="LoRA RL", unit="step", disable=not progress, file=bar_file)
    for step in bar:
        t0 = time.perf_counter()
        prompts = task.prompts(cfg.prompts, g)
        serving = getattr(rollout.client.current, "lora_name", None) or "the base model (no adapter yet)"
        try:
            samples = rollout.generate(prompts, cfg.group, cfg.max_tokens, step)
        except Exception as e:
            raise DemoError(
                f"step {step}: the rollout engine failed ({type(e).__name__}: {e}); "
                f"it was serving {serving}. Restart the demo to resume from a fresh engine."
            ) from e
        t_roll = time.perf_counter() - t0
        rewards = torch.tensor([task.reward(s.tokens) for s in samples], dtype=torch.float64)
        t1 = time.perf_counter()
        rec = train_step(trainer, samples, rewards, cfg, rollout.topk)
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        adapter = trainer.export_adapter()
        t_export = time.perf_counter() - t2
        path, pub = sync.publish(adapter, step + 1)
        try:
            received = sync.receive(step + 1)
            req = rollout.load_adapter(received)
        except (AdapterSyncError, AdapterRejected) as e:
            raise DemoError(
                f"step {step}: adapter version {step + 1} at {path} was rejected before reaching the "
                f"engine: {e}. The engine keeps serving {serving}."
            ) from e
        t_sync = time.perf_counter() - t2
        rec.update(
            {
                "step": step,
                "rollout/raw_reward": float(rewards.mean()),
                "perf/rollout_s": t_roll,
                "perf/train_s": t_train,
                "perf/sync_s": t_sync,
                "perf/sync_bytes": pub["bytes"],
                "perf/checksum_share_of_sync": received.extra.get("sync_timings", {}).get("verify_s", 0.0) / t_sync,
                "rollout/adapter": getattr(req, "lora_name", str(req)),
                "perf/sync_export_s": t_export,
                # where the sync's seconds went, as the transport timed them (build_s, verify_s, load_s, ...)
                **{f"perf/sync_{k}": v for k, v in received.extra.get("sync_timings", {}).items() if k != "bytes"},
            }
        )
        records.append(rec)
        with open(mpath, "a") as f:
            f.write(json.dumps(rec) + "\n")
        lp_diff, kl = rec["train/train_rollout_logprob_abs_diff"], rec["train/train_rollout_kl"]
        bar.set_postfix(reward=f"{rec['rollout/raw_reward']:.3f}", lp_diff=f"{lp_diff:.4f}", sync=f"{t_sync:.2f}s")
        log.info(
            "step %d reward %.3f train/rollout |dlogp| %.4f KL %.2e sync %.2fs",
            step,
            rec["rollout/raw_reward"],
            lp_diff,
            kl,
            t_sync,
        )
    return records


def plot_rewards(records: list[dict], chance: float, path: str, title: str) -> None:
    """``reward.png``: mean reward per step with the uniform-sampler level, under ``title`` (what was trained;
    skipped, with a warning, without matplotlib: :func:`kimi_rl_glue.plotting.pyplot`)."""
    from kimi_rl_glue.plotting import pyplot

    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["rollout/raw_reward"] for r in records], marker=".", label="mean reward")
    ax.axhline(chance, color="gray", ls="--", label="uniform sampler")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (fraction of target tokens)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
