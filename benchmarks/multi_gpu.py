"""kimi_megatron_plugin on 2 GPUs with NCCL: TP=2, PP=2 and EP=2 give the one-GPU logits, loss and gradients.

Each case spawns 2 NCCL processes (rank r on ``cuda:r``) with the workers of the CPU parallel
tests (``tests/kimi_megatron_plugin/mp_worker.py`` and ``lora/lora_mp_worker.py``) and runs the
layouts ``single`` (1 GPU's computation, replicated), ``tp2``, ``pp2`` and ``ep2`` (EP 2 x DP 2) in one
world, each: build from the HF checkpoint (every rank reads only its shard), W4A16 experts from
the packed bytes (Triton kernels in bf16), forward + backward of ``sum(logits * w)``.

Cases:

``tiny``   tiny K2 (INT4), K3 and K3.1 (MXFP4) checkpoints from ``kimi-rl make-tiny`` (4 layers: KDA,
           MLA, latent MoE, bank, K3.1 indexer): logits and every parameter's gradient (TP/EP pieces
           gathered), then LoRA (shared-outer, normalised rank) logits, loss and LoRA-factor gradients.
``slice``  real-width 2-layer checkpoints (hidden 7168, true-size experts: K3/K3.1 MXFP4 3584->3072,
           K2 INT4 7168->2048; 16 experts, top-4 (the LoRA rank 4 is normalised by top-k); vocab cut to 8192) generated on the machine: LoRA
           logits, loss and LoRA-factor gradients (full gradients of a real-width model are too
           large to ship between processes for a check).
``sched``  tiny models, PP=2 through megatron-core's own 1F1B schedule (``get_forward_backward_func``,
           one micro-batch per batch row) vs the one-GPU run through the same schedule, for both ways
           the packed attention-residual bank crosses stages: ``varlen`` (``variable_seq_lengths``
           + alltoall dispatcher, miles' flags) and ``adjust`` (``adjust_tensor_shapes_fn`` =
           ``kimi_megatron_plugin.pipeline.bank_tensor_shapes_fn``, allgather dispatcher).

fp32 (TF32 off) is the equivalence gate (the exit status): 1e-4 relative RMS for logits and every
gradient tensor; 1e-3 for the real-width slice's LoRA-factor gradients (see FP32_GRAD_TOL_SLICE). bf16 is reported against bf16's own noise: the bar is 3x the one-GPU bf16 run's
error against the one-GPU fp32 run (floor 1e-2), for logits and the median gradient tensor; on tiny
random MoE models a last-bit difference flips expert top-k choices (and K3.1's indexer token
top-k), so a layout can land above that bar without a defect: such rows say so and do not fail.
KDA runs kimi_core's reference chunked form (``KIMI_KDA_KERNEL=reference``), as fla's backward
needs a warm Triton cache (docs/megatron.md).

    python benchmarks/multi_gpu.py [--cases tiny,slice,sched] [--models k2,k3,k31]   # 2 GPUs
    python benchmarks/multi_gpu.py --smoke                                      # CPU/gloo, tiny K3.1 only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "kimi_megatron_plugin"))
sys.path.insert(0, os.path.join(ROOT, "tests", "kimi_megatron_plugin", "lora"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_mp_worker  # noqa: E402
import mp_worker  # noqa: E402
from results import append, git_commit, today  # noqa: E402

LAYOUTS = ("tp2", "pp2", "ep2")
FP32_TOL = 1e-4
# Real width: a LoRA-factor gradient is a sum over 7168-wide products of ~6 tokens per expert, in a
# different order per layout; measured 1.5-2.0e-4 worst (median <= 7.7e-5) with logits <= 4.4e-6.
FP32_GRAD_TOL_SLICE = 1e-3
BF16_FACTOR, BF16_FLOOR = 3.0, 1e-2


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    r, g = ref.double(), got.double()
    den = r.pow(2).mean().sqrt().item()
    num = (g - r).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def _flat(grads: dict) -> dict[str, torch.Tensor]:
    """``{name: tensor | (A, B)}`` -> ``{name[.A|.B]: tensor}``."""
    out = {}
    for k, v in grads.items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        else:
            for tag, t in zip("AB", v):
                out[f"{k}.{tag}"] = t
    return out


def merged(payloads: list[dict], key: str = "grads") -> dict[str, torch.Tensor]:
    out = {}
    for p in payloads:
        out.update(_flat(p[key]))
    return out


def first(payloads: list[dict], key: str):
    return next(p[key] for p in payloads if p.get(key) is not None)


# ------------------------------------------------------------------------------------- checkpoints
def slice_checkpoint(model: str, out_dir: str, experts: int = 16, topk: int = 4, vocab: int = 8192) -> str:
    """A real-width 2-layer checkpoint of ``model`` (k2, k3, k31): release widths, ``experts`` routed
    experts of true size, both layers MoE (K3/K3.1: both MLA), random weights, release quant format."""
    from kimi_core.checkpoint.tiny import tiny_config, tiny_state_dict
    from kimi_core.checkpoint.writer import write_checkpoint
    from kimi_core.release_configs import k2_release_config, k3_release_config, k31_release_config

    cfg = {"k2": k2_release_config, "k3": k3_release_config, "k31": k31_release_config}[model]()
    text = cfg.get("text_config", cfg)
    text.update(num_hidden_layers=2, first_k_dense_replace=0, vocab_size=vocab)
    if model == "k2":
        text.update(n_routed_experts=experts, num_experts_per_tok=topk, n_group=1, topk_group=1)
        text["moe_layer_freq"] = 1
        cfg["quantization_config"] = tiny_config("k2")["quantization_config"]
        quant = "int4"
    else:
        text.update(num_experts=experts, num_experts_per_token=topk)
        text["linear_attn_config"].update(full_attn_layers=[1, 2], kda_layers=[])
        quant = "mxfp4"
    write_checkpoint(out_dir, tiny_state_dict(cfg, quant), cfg, max_shard_bytes=512 << 20)
    return out_dir


def tiny_checkpoint(model: str, out_dir: str) -> str:
    from kimi_core.checkpoint.tiny import make_tiny

    return make_tiny(model, out_dir, layers=4)


# ------------------------------------------------------------------------------------- comparisons
def compare(runs: dict[str, dict], full_grads: bool, grad_tol: float = FP32_TOL) -> list[dict]:
    """Rows per (dtype, layout): logits / loss / gradient errors vs the one-GPU run of the same dtype.

    ``runs[dtype][layout]`` is the list of rank payloads; ``grad_tol``: the fp32 gradient bar."""
    rows = []
    base32 = runs["fp32"]["single"]
    for dtype, res in runs.items():
        single = res["single"]
        logits0 = first(single, "logits")
        g0 = merged(single)
        bar_logits, bar_grad = FP32_TOL, grad_tol
        noise = {}
        if dtype == "bf16":  # the one-GPU bf16 run's own error vs fp32 sets the bar
            g32 = merged(base32)
            noise["logits"] = rel(first(base32, "logits"), logits0)
            noise["grad"] = statistics.median(rel(g32[k], g0[k]) for k in g32)
            bar_logits = max(BF16_FACTOR * noise["logits"], BF16_FLOOR)
            bar_grad = max(BF16_FACTOR * noise["grad"], BF16_FLOOR)
        for layout in LAYOUTS:
            if layout not in res:
                continue
            got = res[layout]
            g = merged(got)
            missing = sorted(set(g0) ^ set(g))
            errs = {k: rel(g0[k], g[k]) for k in g0 if k in g}
            worst = max(errs, key=errs.get)
            med = statistics.median(errs.values())
            e_logits = rel(logits0, first(got, "logits"))
            row = dict(dtype=dtype, layout=layout, logits=e_logits, grad_median=med, grad_worst=errs[worst],
                       worst_name=worst, n=len(errs), missing=len(missing), bar_logits=bar_logits,
                       bar_grad=bar_grad, noise=noise, kind="all params" if full_grads else "LoRA factors")
            if not full_grads:
                l0, l1 = first(single, "loss"), first(got, "loss")
                row["loss"] = abs(l1 - l0) / max(abs(l0), 1e-30)
            if dtype == "fp32":  # the equivalence gate
                row["ok"] = e_logits <= FP32_TOL and errs[worst] <= grad_tol and not missing
            else:  # reported against bf16's own noise; routing / indexer top-k flips make it a loose bar
                row["ok"] = not missing
                row["within_bar"] = e_logits <= bar_logits and med <= bar_grad
            rows.append(row)
    return rows


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def all_checks(ckpt: str, tp: int, pp: int, ep: int, full: bool = True, dtypes=("fp32", "bf16")) -> dict:
    """One rank, one layout: every (full | lora, dtype) payload, so one spawn (process start, imports,
    NCCL init) serves them all."""
    out = {}
    for dt in dtypes:
        if full:
            out[f"full/{dt}"] = mp_worker.one_config(ckpt, tp, pp, ep, dtype=DTYPES[dt])
        out[f"lora/{dt}"] = lora_mp_worker.one_config(ckpt, tp, pp, ep, dtype=DTYPES[dt])
    return out


def schedule_checks(ckpt: str, tp: int, pp: int, ep: int, dtypes=("fp32", "bf16")) -> dict:
    """One rank, one layout, every (schedule, dtype) payload through megatron's own schedule."""
    return {f"{sched}/{dt}": mp_worker.one_config(ckpt, tp, pp, ep, dtype=DTYPES[dt], schedule=sched)
            for sched in mp_worker.SCHEDULES for dt in dtypes}


def run_case(case: str, model: str, workdir: str, backend: str, dtypes: list[str]) -> list[dict]:
    """One 2-process spawn for ``case`` (tiny | slice | sched) and ``model``; a row per variant, dtype and layout.

    Variants: ``full`` (every parameter, tiny) and ``lora`` for tiny / slice; for ``sched`` one per way
    the residual bank crosses megatron's schedule (:data:`mp_worker.SCHEDULES`), PP=2 only.
    """
    t0 = time.time()
    ckpt = os.path.join(workdir, f"{'slice' if case == 'slice' else 'tiny'}_{model}")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        (slice_checkpoint if case == "slice" else tiny_checkpoint)(model, ckpt)
    t_ckpt = time.time() - t0
    if case == "sched":
        names, config_fn, kwargs = ("single", "pp2"), schedule_checks, {"dtypes": tuple(dtypes)}
        variants = list(mp_worker.SCHEDULES)
    else:
        full = case == "tiny"
        names, config_fn, kwargs = ("single", *LAYOUTS), all_checks, {"full": full, "dtypes": tuple(dtypes)}
        variants = (["full"] if full else []) + ["lora"]
    ts = time.time()
    res = mp_worker.spawn(ckpt, os.path.join(workdir, f"{case}_{model}.pt"), names, backend=backend,
                          config_fn=config_fn, kwargs=kwargs)
    print(f"[{case} {model}] checkpoint {t_ckpt:.0f} s, {len(names)} layouts x {len(res['single'][0]) - 1} runs in "
          f"{time.time() - ts:.0f} s", flush=True)
    rows = []
    for v in variants:
        runs = {dt: {layout: [p[f"{v}/{dt}"] for p in res[layout]] for layout in names} for dt in dtypes}
        for r in compare(runs, full_grads=v != "lora", grad_tol=FP32_GRAD_TOL_SLICE if case == "slice" else FP32_TOL):
            rows.append(dict(r, case=case, model=model, **({"layout": f"pp2 {v}"} if case == "sched" else {})))
            print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    loss = f"{r['loss']:.1e}" if "loss" in r else "-"
    bar = f"<= {r['bar_logits']:.1e} / {r['bar_grad']:.1e}"
    return (f"| {r['case']} | {r['model']} | {r['kind']} | {r['dtype']} | {r['layout']} | {r['logits']:.1e} | {loss} | "
            f"{r['grad_median']:.1e} | {r['grad_worst']:.1e} (`{r['worst_name'][-48:]}`) | {r['n']} | {bar} | "
            f"{_verdict(r)} |")


def _verdict(r: dict) -> str:
    if not r["ok"]:
        return "FAIL"
    if r["dtype"] == "fp32":
        return "ok"
    return "within bar" if r["within_bar"] else "above bar (reported)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="tiny,slice")
    ap.add_argument("--models", default="k31,k3,k2")
    ap.add_argument("--slice-models", default="k3,k31,k2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny K3.1, fp32 (checks the script)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--section-out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("KIMI_KDA_KERNEL", "reference")
    backend = "gloo" if args.smoke else "nccl"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise SystemExit(f"multi_gpu.py needs 2 GPUs, found {torch.cuda.device_count()} (use --smoke on a CPU)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="kimi_mgpu_")
    dtypes = ["fp32"] if args.smoke else args.dtypes.split(",")
    plan = []
    for case in args.cases.split(","):
        models = args.slice_models if case == "slice" else args.models
        plan += [(case, m) for m in (["k31"] if args.smoke else models.split(","))]
        if args.smoke:
            break
    rows, failed = [], []
    for case, model in plan:
        try:
            rows += run_case(case, model, workdir, backend, dtypes)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others' rows
            failed.append(f"{case} {model}: {type(e).__name__}: {str(e)[-400:]}")
            print("FAILED", failed[-1], flush=True)
    hdr = ("| case | model | gradients of | dtype | layout | logits rel | loss rel | grad median rel | "
           "grad worst rel | tensors | bar (logits / median grad) | |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    dev = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if backend == "nccl" else "CPU (gloo smoke)"
    import megatron.core

    section = (f"\n## Megatron plugin on 2 GPUs (NCCL): TP=2 / PP=2 / EP=2 vs one GPU\n\n- date: {today()}\n"
               f"- machine: {dev}, torch {torch.__version__}, megatron-core {megatron.core.__version__}\n"
               f"- commit: {git_commit()}\n- command: `python benchmarks/multi_gpu.py {' '.join(sys.argv[1:])}`\n"
               f"- every layout runs in 2 processes; relative RMS vs the one-GPU run of the same dtype; bf16 bar ="
               f" {BF16_FACTOR:.0f}x the one-GPU bf16-vs-fp32 error (floor {BF16_FLOOR:.0e})\n\n"
               + hdr + "\n".join(_row(r) for r in rows) + "\n"
               + "".join(f"\n- FAILED {f}" for f in failed) + "\n")
    print(section)
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(section)
    if not args.no_append and not args.smoke:
        append(section)
    if failed or not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
