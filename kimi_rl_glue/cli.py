"""``kimi-rl``: the command-line entry point (console script of kimi-rl-plugins).

Every flag has a ``help=``; every value is checked before long work starts, and every refusal is one line
on stderr naming the flag, file or tensor (``docs/cli.md`` lists them). Exit codes: 0 done, 1 a bad input
file (truncated shard, malformed tensor, missing file), 2 a usage error (a flag's value, an output folder
the command will not write into, a checkpoint that is not its own fixed point), 3 ``check-numerics`` flagged
a pair, 130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kimi_core.errors import KimiError

USAGE_EXIT = 2  # as argparse


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kimi-rl demo: error: argument --steps: ...`` (exit 2)."""

    def error(self, message):
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _UsageError(KimiError, ValueError):
    """A flag value refused by a check that needs more than the flag (another flag, the machine)."""


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    parse.__name__ = f"integer >= {low}"
    return parse


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        v = _int_at_least(low)(text)
        if v > high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {v}")
        return v

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _make_tiny(a) -> int:
    from kimi_core.checkpoint.tiny import make_tiny

    convention = a.convention or "kimi"
    quant = a.quant or ("mxfp4" if a.model in ("k3", "k31") else "int4")
    if a.convention and quant != "int4":
        raise _UsageError(
            f"--convention {a.convention}: only INT4 experts have a scale convention; --model "
            f"{a.model} with --quant {quant} has none"
        )
    path = make_tiny(
        a.model,
        a.out,
        quant=a.quant,
        convention=convention,
        seed=a.seed,
        layers=a.layers,
        size=a.size,
        max_shard_bytes=(2 if a.size == "tiny" else 256) * 2**20,
    )
    print(f"wrote {a.size} {a.model} checkpoint to {path}")
    return 0


def _dequantize(a) -> int:
    from kimi_core.checkpoint.dequantize import VerificationError, dequantize_checkpoint

    try:
        rep = dequantize_checkpoint(
            a.input, a.output, scale_divisor=a.scale_divisor, q_min=a.q_min, verify=not a.no_verify, workers=a.workers
        )
    except VerificationError as e:
        print(f"error: verification failed for {a.input}: {e}", file=sys.stderr)
        return USAGE_EXIT
    print(
        f"dequantized {rep.dequantized} tensors, copied {rep.copied}, wrote {len(rep.written_shards)} shard(s) "
        f"to {a.output}" + ("" if a.no_verify or not rep.written_shards else " (all verified as fixed points)")
    )
    if rep.skipped_shards:
        print(
            f"skipped {len(rep.skipped_shards)} shard(s) finished earlier from the same input and settings; "
            "they were NOT re-verified: " + ", ".join(rep.skipped_shards)
        )
    return 0


def _doctor(a) -> int:
    from kimi_rl_glue.doctor import main

    return main(a)


def _check_numerics(a) -> int:
    from kimi_rl_glue.numerics import compare
    from kimi_rl_glue.numerics.compare import check_engines, default_engines

    engines = [e for e in (a.engines or default_engines(a.dtype)).split(",") if e]
    try:
        check_engines(engines, a.dtype)  # before the reference samples anything
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if not os.path.isdir(a.model):
        raise _UsageError(f"--model {a.model}: not a checkpoint folder")
    rep = compare(
        a.model,
        adapter=a.adapter,
        engines=engines,
        tokens=a.tokens,
        seed=a.seed,
        dtype=a.dtype,
        out=a.out,
        batch=a.batch,
    )
    print(rep.table())
    if a.out:
        png = os.path.join(a.out, "logprob_diff.png")
        print(
            f"report: {a.out}/report.json"
            + (f", plot: {png}" if os.path.exists(png) else " (no plot: matplotlib missing)")
        )
    return 3 if any(p.flagged for p in rep.pairs) else 0


def _demo(a) -> int:
    from kimi_rl_glue.demo.recipes import RECIPES

    recipe = RECIPES[a.recipe]
    if recipe.engine == "sglang" and a.device != "cuda":
        raise _UsageError(
            f"--recipe {recipe.name} serves with SGLang's GPU kernels (KDA, attention residuals, Marlin "
            "MXFP4 MoE), which have no CPU path; run it with --device cuda (--size small on one GPU)"
        )
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise _UsageError(
                "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); use --device cpu"
            )
    from kimi_rl_glue.demo.command import main

    return main(a)


_TOKEN_SET_FLAGS = ("checkpoint", "prompts", "targets", "prompt_len", "seed")  # --format skyrl --task token-set
_MILES_FLAGS = ("input", "limit", "add_boxed_instruction")  # --format miles


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _prepare_data(a) -> int:
    from kimi_core.checkpoint.tokenizer import FIRST_WORD_ID
    from kimi_rl_glue.data import SKYRL_TASKS, checkpoint_vocab_size, prepare_data, prepare_token_set

    fmt = a.format or ("skyrl" if a.task in SKYRL_TASKS else "miles")
    if (fmt == "skyrl") != (a.task in SKYRL_TASKS):
        raise _UsageError(
            f"--format {fmt} with --task {a.task}: --task token-set is written as SkyRL parquet (--format skyrl), "
            "dapo-math / aime as miles JSONL (--format miles)"
        )
    other = _MILES_FLAGS if fmt == "skyrl" else _TOKEN_SET_FLAGS
    stray = [_flag(d) for d in other if getattr(a, d) not in (None, False)]
    if stray:
        raise _UsageError(f"{', '.join(stray)}: not a flag of --format {fmt} --task {a.task}")
    if fmt == "miles":
        if a.input is None:
            raise _UsageError(f"--input: --task {a.task} converts a local file; name it with --input")
        try:
            rep = prepare_data(a.task, a.input, a.output, limit=a.limit, add_boxed_instruction=a.add_boxed_instruction)
        except ImportError as e:  # parquet without pyarrow
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(
            f"wrote {rep.rows} {a.task} rows to {rep.output} (miles: --input-key prompt --label-key label)"
            + (f"; skipped {len(rep.skipped)} row(s) without prompt/label" if rep.skipped else "")
        )
        return 0
    if a.checkpoint is None:
        raise _UsageError("--checkpoint: --task token-set takes its words from a checkpoint's tokenizer; name it")
    if not a.output.endswith(".parquet"):
        raise _UsageError(f"--output {a.output}: SkyRL picks its reader by the suffix; name a .parquet file")
    targets, prompt_len, seed = a.targets or 64, a.prompt_len or 8, a.seed or 0
    words = checkpoint_vocab_size(a.checkpoint) - FIRST_WORD_ID  # a bad folder: exit 1
    if targets >= words:
        raise _UsageError(
            f"--targets {targets}: the tokenizer of {a.checkpoint} has {words} words; leave at least one outside "
            "the target set for the prompts"
        )
    try:
        rep = prepare_token_set(
            a.checkpoint, a.output, prompts=a.prompts or 64, seed=seed, n_targets=targets, prompt_len=prompt_len
        )
    except ImportError as e:  # no pyarrow
        print(f"kimi-rl prepare-data: error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {rep.rows} token-set rows to {rep.output} (SkyRL: environment.env_class=kimi_token_set; "
        f"{targets} target words, {prompt_len} words a prompt, seed {seed})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kimi-rl", description="Kimi K2.x / K3 / K3.1 LoRA RL plugins")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (and, for demo, the hosts' own output)")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in the real on-disk format")
    t.add_argument("--model", required=True, choices=["k2", "k25", "k3", "k31"], help="the Kimi release to mimic")
    t.add_argument(
        "--out", required=True, help="checkpoint folder to write; an earlier checkpoint there is replaced as a whole"
    )
    t.add_argument(
        "--quant",
        choices=["int4", "mxfp4", "none"],
        default=None,
        help="expert format (default: the release's: int4 for K2.x, mxfp4 for K3/K3.1)",
    )
    t.add_argument(
        "--convention",
        choices=["kimi", "rtn"],
        default=None,
        help="INT4 scale convention (INT4 experts only): kimi = amax/7, q in [-7,7] (default); "
        "rtn = amax/7.5, q in [-8,7]",
    )
    t.add_argument("--seed", type=int, default=0, help="weights' random seed")
    t.add_argument("--layers", type=_int_in(2, 6), default=None, help="decoder layers, 2..6 (default: the model's)")
    t.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="tiny",
        help="tiny: CPU tests (hidden 256, 16 experts); small: GPU demos (hidden 1024, release MLA "
        "head sizes, 64 experts top-8, widths the GPU engines' kernels take)",
    )
    t.set_defaults(fn=_make_tiny)

    d = sub.add_parser("dequantize", help="write BF16 masters of an INT4/MXFP4 checkpoint, verified")
    d.add_argument("--input", required=True, help="the 4-bit checkpoint folder (never written)")
    d.add_argument(
        "--output",
        required=True,
        help="new or empty folder, or one an interrupted run from the same input and settings left "
        "(it resumes); not the input, inside it, or containing it",
    )
    d.add_argument(
        "--scale-divisor",
        type=_positive_float,
        default=7.0,
        help="INT4 grid the masters are verified on: scale = amax / this (Kimi 7.0)",
    )
    d.add_argument("--q-min", type=_int_in(-8, -1), default=-7, help="INT4 grid's lowest code (Kimi -7)")
    d.add_argument(
        "--no-verify",
        action="store_true",
        help="write plain BF16 weights without checking they re-quantize to the input's bytes",
    )
    d.add_argument("--workers", type=_int_at_least(1), default=1, help="shards dequantized in parallel processes")
    d.set_defaults(fn=_dequantize)

    doc = sub.add_parser("doctor", help="report Python, torch, installed hosts and our entry points")
    doc.set_defaults(fn=_doctor)

    n = sub.add_parser("check-numerics", help="train/rollout logprob consistency across reference, trainer, engines")
    n.add_argument("--model", required=True, help="checkpoint directory")
    n.add_argument("--adapter", default=None, help="PEFT adapter directory")
    n.add_argument(
        "--engines",
        default=None,
        help="comma list; 'name@DIR' runs an engine on another checkpoint (default: reference,vllm "
        "with --dtype bf16; reference,megatron,vllm with --dtype fp32: megatron scores in fp32 only)",
    )
    n.add_argument("--tokens", type=_int_at_least(1), default=32, help="sampled tokens per sequence")
    n.add_argument("--batch", type=_int_at_least(1), default=2, help="sequences")
    n.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    n.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="dtype of the engines under test (the reference baseline is always fp32)",
    )
    n.add_argument("--out", default=None, help="directory for report.json and logprob_diff.png")
    n.set_defaults(fn=_check_numerics)

    pd = sub.add_parser(
        "prepare-data",
        help="convert a local dapo-math / AIME JSONL or parquet to miles' format, or write SkyRL parquet of the "
        "token-set task",
    )
    pd.add_argument(
        "--task",
        required=True,
        choices=["dapo-math", "aime", "token-set"],
        help="dapo-math / aime: the input's row layout; token-set: the demo's task, generated (a tiny model earns "
        "a reward on it)",
    )
    pd.add_argument(
        "--format",
        choices=["miles", "skyrl"],
        default=None,
        help="miles: prompt JSONL (dapo-math, aime); skyrl: parquet with prompt, env_class, reward_model "
        "(token-set); default: the task's",
    )
    pd.add_argument(
        "--input", default=None, help="dapo-math / aime: local .jsonl/.json/.parquet (nothing is downloaded)"
    )
    pd.add_argument("--output", required=True, help="miles prompt JSONL, or SkyRL .parquet, to write")
    pd.add_argument(
        "--limit", type=_int_at_least(1), default=None, help="dapo-math / aime: keep the first N usable rows"
    )
    pd.add_argument(
        "--add-boxed-instruction",
        action="store_true",
        help="dapo-math / aime: append 'put your final answer within \\boxed{}' to prompts that lack it",
    )
    pd.add_argument(
        "--checkpoint", default=None, help="token-set: the model folder whose tokenizer's words (w<i>) the rows use"
    )
    pd.add_argument("--prompts", type=_int_at_least(1), default=None, help="token-set: number of rows (default 64)")
    pd.add_argument(
        "--targets", type=_int_at_least(1), default=None, help="token-set: size of the hidden target set (default 64)"
    )
    pd.add_argument("--prompt-len", type=_int_at_least(1), default=None, help="token-set: words a prompt (default 8)")
    pd.add_argument(
        "--seed", type=_int_at_least(0), default=None, help="token-set: seed of the target set and prompts (default 0)"
    )
    pd.set_defaults(fn=_prepare_data)

    from kimi_rl_glue.demo.recipes import RECIPES

    demo = sub.add_parser("demo", help="the main job: LoRA RL on a tiny Kimi model on this CPU (or --device cuda)")
    demo.add_argument(
        "--out", default="runs/demo", help="run folder; one that holds an earlier run is refused unless --overwrite"
    )
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="clear an earlier run in --out (swapped out in one rename) and start clean",
    )
    demo.add_argument("--steps", type=_int_at_least(1), default=40, help="RL steps")
    demo.add_argument("--seed", type=int, default=0, help="checkpoint, LoRA, prompt and sampling seed")
    demo.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="cpu-k2",
        help="; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()),
    )
    demo.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: GPU vLLM (0.26+) and the Megatron trainer share the current GPU",
    )
    demo.add_argument("--size", choices=["tiny", "small"], default="tiny", help="make-tiny --size of the checkpoint")
    demo.add_argument("--loss", choices=["score_centering", "grpo_tis"], default=None, help="default: the recipe's")
    demo.add_argument(
        "--trainer",
        choices=["auto", "megatron", "reference"],
        default=None,
        help="default: the recipe's (cpu-k2: auto, skyrl-k2: megatron)",
    )
    demo.add_argument("--rank", type=_int_at_least(1), default=None, help="LoRA rank (default: the recipe's, 8 / 16)")
    demo.add_argument("--lr", type=_positive_float, default=5e-3, help="AdamW learning rate of the LoRA factors")
    demo.add_argument("--prompts", type=_int_at_least(1), default=8, help="prompts per step")
    demo.add_argument("--group", type=_int_at_least(1), default=4, help="samples per prompt")
    demo.add_argument("--max-tokens", type=_int_at_least(1), default=8, help="tokens per response")
    demo.add_argument(
        "--verbose",
        action="store_true",
        dest="demo_verbose",
        help="show the engines' and trainer's own output here instead of in <out>/demo.log",
    )
    demo.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "demo_verbose", False):
        args.verbose = True
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from kimi_core.checkpoint.dequantize import VerificationError
    from kimi_core.checkpoint.folders import FolderRefused

    prog = f"kimi-rl {args.cmd}"
    try:
        return int(args.fn(args) or 0)
    except (_UsageError, FolderRefused, VerificationError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    except (KimiError, ValueError, KeyError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
