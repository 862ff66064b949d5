"""``kimi-rl``: the command-line entry point (console script of kimi-rl-plugins)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _make_tiny(a) -> int:
    from kimi_core.checkpoint.tiny import make_tiny

    path = make_tiny(a.model, a.out, quant=a.quant, convention=a.convention, seed=a.seed, layers=a.layers,
                     size=a.size, max_shard_bytes=(2 if a.size == "tiny" else 256) * 2**20)
    print(f"wrote {a.size} {a.model} checkpoint to {path}")
    return 0


def _dequantize(a) -> int:
    from kimi_core.checkpoint.dequantize import VerificationError, dequantize_checkpoint

    try:
        rep = dequantize_checkpoint(a.input, a.output, scale_divisor=a.scale_divisor, q_min=a.q_min,
                                    verify=not a.no_verify, workers=a.workers)
    except VerificationError as e:
        print(f"error: verification failed for {a.input}: {e}", file=sys.stderr)
        return 2
    print(f"dequantized {rep.dequantized} tensors, copied {rep.copied}, wrote {len(rep.written_shards)} shard(s) "
          f"to {a.output}" + ("" if a.no_verify or not rep.written_shards else " (all verified as fixed points)"))
    if rep.skipped_shards:
        print(f"skipped {len(rep.skipped_shards)} shard(s) finished earlier; they were NOT re-verified: "
              + ", ".join(rep.skipped_shards))
    return 0


def _doctor(a) -> int:
    from kimi_rl_glue.doctor import main

    return main(a)


def _check_numerics(a) -> int:
    from kimi_rl_glue.numerics import compare

    rep = compare(a.model, adapter=a.adapter, engines=[e for e in a.engines.split(",") if e], tokens=a.tokens,
                  seed=a.seed, dtype=a.dtype, out=a.out, batch=a.batch)
    print(rep.table())
    if a.out:
        png = os.path.join(a.out, "logprob_diff.png")
        print(f"report: {a.out}/report.json" + (f", plot: {png}" if os.path.exists(png) else " (no plot: matplotlib missing)"))
    return 3 if any(p.flagged for p in rep.pairs) else 0


def _demo(a) -> int:
    from kimi_rl_glue.demo.command import main

    return main(a)


def _prepare_data(a) -> int:
    from kimi_rl_glue.data import prepare_data

    try:
        rep = prepare_data(a.task, a.input, a.output, limit=a.limit, add_boxed_instruction=a.add_boxed_instruction)
    except ImportError as e:  # parquet without pyarrow
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {rep.rows} {a.task} rows to {rep.output} (miles: --input-key prompt --label-key label)"
          + (f"; skipped {len(rep.skipped)} row(s) without prompt/label" if rep.skipped else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-rl", description="Kimi K2.x / K3 / K3.1 LoRA RL plugins")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in the real on-disk format")
    t.add_argument("--model", required=True, choices=["k2", "k25", "k3", "k31"])
    t.add_argument("--out", required=True)
    t.add_argument("--quant", choices=["int4", "mxfp4", "none"], default=None,
                   help="expert format (default: the release's: int4 for K2.x, mxfp4 for K3/K3.1)")
    t.add_argument("--convention", choices=["kimi", "rtn"], default="kimi",
                   help="INT4 scale convention: kimi = amax/7, q in [-7,7]; rtn = amax/7.5, q in [-8,7]")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=None)
    t.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="tiny: CPU tests (hidden 256, 16 experts); small: GPU demos (hidden 1024, release MLA "
                        "head sizes, 64 experts top-8, widths the GPU engines' kernels take)")
    t.set_defaults(fn=_make_tiny)

    d = sub.add_parser("dequantize", help="write BF16 masters of an INT4/MXFP4 checkpoint, verified")
    d.add_argument("--input", required=True)
    d.add_argument("--output", required=True)
    d.add_argument("--scale-divisor", type=float, default=7.0)
    d.add_argument("--q-min", type=int, default=-7)
    d.add_argument("--no-verify", action="store_true")
    d.add_argument("--workers", type=int, default=1)
    d.set_defaults(fn=_dequantize)

    doc = sub.add_parser("doctor", help="report Python, torch, installed hosts and our entry points")
    doc.set_defaults(fn=_doctor)

    n = sub.add_parser("check-numerics", help="train/rollout logprob consistency across reference, trainer, engines")
    n.add_argument("--model", required=True, help="checkpoint directory")
    n.add_argument("--adapter", default=None, help="PEFT adapter directory")
    n.add_argument("--engines", default="reference,megatron,vllm",
                   help="comma list; 'name@DIR' runs an engine on another checkpoint")
    n.add_argument("--tokens", type=int, default=32, help="sampled tokens per sequence")
    n.add_argument("--batch", type=int, default=2)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    n.add_argument("--out", default=None, help="directory for report.json and logprob_diff.png")
    n.set_defaults(fn=_check_numerics)

    pd = sub.add_parser("prepare-data", help="convert a local dapo-math / AIME JSONL or parquet to miles' format")
    pd.add_argument("--task", required=True, choices=["dapo-math", "aime"])
    pd.add_argument("--input", required=True, help="local .jsonl/.json/.parquet (nothing is downloaded)")
    pd.add_argument("--output", required=True, help="miles prompt JSONL to write")
    pd.add_argument("--limit", type=int, default=None, help="keep the first N usable rows")
    pd.add_argument("--add-boxed-instruction", action="store_true",
                    help="append 'put your final answer within \\boxed{}' to prompts that lack it")
    pd.set_defaults(fn=_prepare_data)

    from kimi_rl_glue.demo.recipes import RECIPES

    demo = sub.add_parser("demo", help="the main job: LoRA RL on a tiny Kimi model on this CPU (or --device cuda)")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--steps", type=int, default=None)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--recipe", choices=sorted(RECIPES), default="cpu-k2",
                      help="; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()))
    demo.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                      help="cuda: GPU vLLM (0.26+) and the Megatron trainer share the current GPU")
    demo.add_argument("--size", choices=["tiny", "small"], default="tiny", help="make-tiny --size of the checkpoint")
    demo.add_argument("--loss", choices=["score_centering", "grpo_tis"], default=None, help="default: the recipe's")
    demo.add_argument("--trainer", choices=["auto", "megatron", "reference"], default=None,
                      help="default: the recipe's (cpu-k2: auto, skyrl-k2: megatron)")
    demo.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the recipe's, 8 / 16)")
    demo.add_argument("--lr", type=float, default=5e-3)
    demo.add_argument("--prompts", type=int, default=8, help="prompts per step")
    demo.add_argument("--group", type=int, default=4, help="samples per prompt")
    demo.add_argument("--max-tokens", type=int, default=8, help="tokens per response")
    demo.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
