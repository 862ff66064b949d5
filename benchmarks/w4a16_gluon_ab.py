"""Before / after timing of the Gluon W4A16 kernels in one process (issue #21).

A kernel change is judged against the kernels it replaces on the same GPU, in the same process, interleaved: two
machines of one kind differ by several per cent (benchmarks/RESULTS.md, 2026-12-06), more than most kernel changes.
``export`` copies a revision's ``kimi_core/kernels/gluon_w4a16.py`` and ``gluon_w4a16_rs.py`` into
``benchmarks/_ab_before/`` (git-ignored; carry it to the GPU machine), their imports of each other pointed at the
copies; ``run`` times those against the working tree's, both with ``kimi_core.kernels.GLUON_OPTIONS`` (what the
dispatcher runs, ``--options`` adds keyword arguments, e.g. ``'{"fold_scales": true}'``, ``--before-options`` other
ones for the exported side: one revision exported can so time an option against its absence; ``--self`` puts the
working tree's kernels on both sides, so an option is timed without any export), twice each,
alternating, the best of each, beside BF16 ``_grouped_mm``, and says whether the two outputs are bitwise equal.

    python benchmarks/w4a16_gluon_ab.py export 639daea          # CPU machine, a git checkout
    python benchmarks/w4a16_gluon_ab.py run --tokens 512,2048    # GPU machine (carry benchmarks/_ab_before)
    python benchmarks/w4a16_gluon_ab.py run --fmts mxfp4 --options '{"fold_scales": true}' --before-options '{}'
    python benchmarks/w4a16_gluon_ab.py run --self --options '{"fold_scales": true}' --before-options '{}'
    python benchmarks/w4a16_gluon_ab.py run --fused --tokens 8 --fmts mxfp4 --options '{"fold_scales": true}' \
        --before-options '{}'                                    # the fused Triton kernels, an option against its absence
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BEFORE = os.path.join(HERE, "_ab_before")
MODULES = ("gluon_w4a16", "gluon_w4a16_rs")


def export(rev: str) -> None:
    """Write ``rev``'s Gluon kernel modules to :data:`BEFORE` as ``before_<name>.py`` (imports between them
    rewritten), each through a temporary name and ``os.replace``."""
    os.makedirs(BEFORE, exist_ok=True)
    for name in MODULES:
        text = subprocess.run(["git", "show", f"{rev}:kimi_core/kernels/{name}.py"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(HERE)).stdout
        for other in MODULES:
            text = text.replace(f"from kimi_core.kernels import {other} as", f"import before_{other} as")
            text = text.replace(f"from kimi_core.kernels.{other} import", f"from before_{other} import")
        path = os.path.join(BEFORE, f"before_{name}.py")
        with open(path + ".tmp", "w") as f:
            f.write(f"# {name}.py at {rev} (benchmarks/w4a16_gluon_ab.py export)\n" + text)
        os.replace(path + ".tmp", path)
    print(f"{rev}'s {', '.join(MODULES)} -> {BEFORE}")


def run(tokens: list[int], ops: list[str], fmts: list[str], extra: dict, before_extra: dict | None = None,
        itself: bool = False, fused: bool = False) -> None:
    """Print one markdown row per shape x format x tokens x op: BF16 ms, before / after ms and speed vs BF16, after
    / before speed, and whether the outputs are bitwise equal. ``itself``: the working tree's kernels on both sides
    (only the options differ); ``fused``: the working tree's fused Triton kernels (:mod:`.triton_w4a16`, their own
    tile pick) on both sides, the options their keyword arguments."""
    import torch

    itself = itself or fused
    if not itself and not os.path.isdir(BEFORE):
        sys.exit(f"{BEFORE} is missing: run `python benchmarks/w4a16_gluon_ab.py export REV` first (and carry it)")
    sys.path.insert(0, BEFORE)
    sys.path.insert(0, HERE)
    import w4a16_grouped_gemm as wb

    from kimi_core.kernels import GLUON_OPTIONS

    after = importlib.import_module("kimi_core.kernels." + ("triton_w4a16" if fused else "gluon_w4a16_rs"))
    before = after if itself else importlib.import_module("before_gluon_w4a16_rs")
    base = {"fwd": {}, "dgrad": {}} if fused else GLUON_OPTIONS
    before_extra = extra if before_extra is None else before_extra
    what = "its own tile pick" if fused else "GLUON_OPTIONS"
    print(f"before: {before.__file__} with {what} + {json.dumps(before_extra)}\n"
          f"after: {after.__file__} with {what} + {json.dumps(extra)}\n")
    print("| shape | fmt | tok/exp | op | BF16 ms | before ms (vs BF16) | after ms (vs BF16) | after / before speed "
          "| outputs |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, E, K, N in wb.SHAPES:
        for fmt in (f for f in wb.FORMATS if wb.fmt_name(f).lower() in fmts):
            wp, ws = wb.random_weights(fmt, E, N, K)
            w_bf16 = wb.bf16_layer(fmt, wp, ws)
            for tpe in tokens:
                T, splits = E * tpe, [tpe] * E
                offs = torch.arange(1, E + 1, device=wb.DEV, dtype=torch.int32) * tpe
                x = torch.randn(T, K, device=wb.DEV).bfloat16()
                dy = torch.randn(T, N, device=wb.DEV).bfloat16()
                bf16 = wb.bf16_ops(x, dy, w_bf16, offs)
                for op in ops:
                    a = x if op == "fwd" else dy
                    opts = {side: {k: v for k, v in {**base[op], **more}.items() if k != "kernel"}
                            for side, more in (("before", before_extra), ("after", extra))}
                    fns = {side: getattr(mod, "grouped_gemm" if op == "fwd" else "grouped_gemm_dgrad")
                           for side, mod in (("before", before), ("after", after))}
                    same = torch.equal(fns["before"](a, wp, ws, fmt, splits, **opts["before"]),
                                       fns["after"](a, wp, ws, fmt, splits, **opts["after"]))
                    t_bf16 = wb.bench(bf16[op], reps=10)
                    best = {"before": float("inf"), "after": float("inf")}
                    for _ in range(2):
                        for side, fn in fns.items():
                            best[side] = min(best[side], wb.bench(
                                lambda: fn(a, wp, ws, fmt, splits, **opts[side]), reps=10))
                    print(f"| {name} | {wb.fmt_name(fmt)} | {tpe} | {op} | {t_bf16:.3f} | {best['before']:.3f} "
                          f"({t_bf16 / best['before']:.3f}x) | {best['after']:.3f} ({t_bf16 / best['after']:.3f}x) | "
                          f"{best['before'] / best['after']:.3f} | {'bitwise equal' if same else 'DIFFERENT'} |",
                          flush=True)
            del w_bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="copy a revision's Gluon kernel modules to benchmarks/_ab_before/")
    ex.add_argument("rev")
    rn = sub.add_parser("run", help="time them against the working tree's (GPU)")
    rn.add_argument("--tokens", default="128,512,2048", help="tokens per expert, comma-separated")
    rn.add_argument("--ops", default="fwd,dgrad")
    rn.add_argument("--fmts", default="mxfp4,int4")
    rn.add_argument("--options", default="{}", help="JSON keyword arguments added to GLUON_OPTIONS")
    rn.add_argument("--before-options", default=None, help="JSON, the exported side's (default: --options)")
    rn.add_argument("--self", action="store_true", help="the working tree's kernels on both sides (no export)")
    rn.add_argument("--fused", action="store_true",
                    help="the working tree's fused Triton kernels on both sides (their own tile pick; no export)")
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.rev)
    else:
        before_options = None if args.before_options is None else json.loads(args.before_options)
        run([int(t) for t in args.tokens.split(",")], args.ops.split(","), args.fmts.split(","),
            json.loads(args.options), before_options, itself=args.self, fused=args.fused)


if __name__ == "__main__":
    main()
