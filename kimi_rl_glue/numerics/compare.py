"""``kimi_rl_glue.numerics.compare``: run the same sampled sequences through every engine and compare.

Sequences: ``batch`` random prompts of ``prompt_len`` tokens, each continued by ``tokens`` tokens
sampled (temperature 1) from the first engine, as a rollout would; every engine then scores the
whole sequence. Statistics are taken over the sampled positions only (see :mod:`.report`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from kimi_rl_glue.numerics.engines import ENGINES, EngineResult
from kimi_rl_glue.numerics.report import PairStats, compare_pair, format_table

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A pair is flagged when a logprob differs by more than this (bf16 engines sit around 1e-2 on tiny
# models) or a hidden state diverges by more than LAYER_TOL relative RMS.
DEFAULT_TOL_ABS = {"fp32": 1e-3, "bf16": 5e-2}
DEFAULT_LAYER_TOL = {"fp32": 1e-4, "bf16": 3e-2}


@dataclass
class NumericsReport:
    pairs: list[PairStats]
    skipped: dict[str, str]
    per_position: dict[str, list[float]]  # "a vs b" -> mean |dlogp| at each sampled position
    input_ids: torch.Tensor

    def table(self) -> str:
        return format_table(self.pairs, self.skipped)

    def as_dict(self) -> dict:
        return {
            "pairs": [p.as_dict() for p in self.pairs],
            "skipped": self.skipped,
            "per_position_abs_diff": self.per_position,
            "input_ids": self.input_ids.tolist(),
        }


def compare_results(
    results: dict[str, EngineResult],
    mask: torch.Tensor,
    dtype: str = "bf16",
    tol_abs: float | None = None,
    layer_tol: float | None = None,
) -> list[PairStats]:
    """Pair statistics of results a caller already has (e.g. the demo's trainer and engine logprobs).

    :param mask: ``[B, T-1]`` positions to compare (the sampled tokens).
    """
    tol_abs = DEFAULT_TOL_ABS[dtype] if tol_abs is None else tol_abs
    layer_tol = DEFAULT_LAYER_TOL[dtype] if layer_tol is None else layer_tol
    names = list(results)
    return [
        compare_pair(a, results[a], b, results[b], mask, tol_abs, layer_tol)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]


#: engines that score only in fp32 (the Megatron trainer builds its parameters in fp32)
FP32_ONLY = ("megatron",)


def default_engines(dtype: str) -> str:
    """``--engines`` when none is given: every engine that scores in ``dtype``."""
    return "reference,megatron,vllm" if dtype == "fp32" else "reference,vllm"


def check_engines(engines, dtype: str, baseline: str = "reference") -> None:
    """Refuse unknown engine names and an fp32-only engine asked for another dtype, before any work.

    :raises ValueError: naming ``--engines`` or ``--dtype``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    for spec in engines:
        name = spec.partition("@")[0]
        if name not in ENGINES:
            raise ValueError(f"--engines: unknown engine {name!r}; known: {sorted(ENGINES)}")
        if name in FP32_ONLY and dtype != "fp32" and spec != baseline:
            raise ValueError(
                f"--engines {spec} with --dtype {dtype}: the {name} engine scores in fp32 only; pass "
                f"--dtype fp32, or leave {name} out of --engines"
            )


def sample_sequences(model_dir: str, batch: int, prompt_len: int, tokens: int, seed: int, adapter=None) -> torch.Tensor:
    """``[batch, prompt_len + tokens]`` token ids: random prompts continued by the reference model."""
    from kimi_core.reference import load_reference_model

    model = load_reference_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g)
    with torch.no_grad():
        state = model.prefill(ids, adapter=adapter)
        for _ in range(tokens):
            nxt = torch.multinomial(torch.softmax(state.logits.float(), -1), 1, generator=g)
            ids = torch.cat([ids, nxt], 1)
            _, state = model.step(state, nxt)
    return ids


def compare(
    model_dir: str,
    adapter=None,
    engines=("reference", "vllm"),
    tokens: int = 32,
    seed: int = 0,
    dtype: str = "bf16",
    out: str | None = None,
    batch: int = 2,
    prompt_len: int = 16,
    baseline: str = "reference",
    tol_abs: float | None = None,
    layer_tol: float | None = None,
    extra_results: dict[str, EngineResult] | None = None,
) -> NumericsReport:
    """Compare engines on the same sampled sequences; write ``report.json`` and ``logprob_diff.png`` to ``out``.

    ``engines`` are names from :data:`ENGINES`, optionally ``name@DIR`` to run an engine on another
    checkpoint with the same config (a trained or re-exported copy, or a deliberately broken one).

    The baseline (the fp32 reference by default) is always computed in fp32; the other engines run
    in ``dtype``; an engine that cannot (``megatron`` scores in fp32 only) is refused with ``dtype="bf16"``
    before anything runs, as is an unknown engine name. ``extra_results`` lets a caller add results it
    computed itself (the demo passes its trainer and engine logprobs).
    """
    check_engines(engines, dtype, baseline)  # before the reference samples anything
    tol_abs = DEFAULT_TOL_ABS[dtype] if tol_abs is None else tol_abs
    layer_tol = DEFAULT_LAYER_TOL[dtype] if layer_tol is None else layer_tol
    ids = sample_sequences(model_dir, batch, prompt_len, tokens, seed, adapter)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    mask[:, prompt_len - 1 :] = True
    results: dict[str, EngineResult] = {}
    skipped: dict[str, str] = {}
    for spec in engines:
        name, _, other_dir = spec.partition("@")  # "engine@DIR" runs the engine on another checkpoint
        eng = ENGINES[name]
        ok, why = eng.available()
        if not ok:
            skipped[spec] = why
            continue
        is_base = spec == baseline
        key = f"{spec}-fp32" if is_base else spec
        log.info("running %s", key)
        results[key] = eng.run(
            other_dir or model_dir, ids, adapter=adapter, dtype=torch.float32 if is_base else DTYPES[dtype]
        )
    results.update(extra_results or {})
    pairs = compare_results(results, mask, dtype, tol_abs, layer_tol)
    per_pos = {}
    for p in pairs:
        d = (results[p.a].logprobs.double() - results[p.b].logprobs.double()).abs()[:, prompt_len - 1 :]
        per_pos[f"{p.a} vs {p.b}"] = d.mean(0).tolist()
    rep = NumericsReport(pairs, skipped, per_pos, ids)
    if out:
        write_report(rep, out)
    return rep


def write_report(rep: NumericsReport, out: str) -> None:
    """``report.json`` and ``logprob_diff.png`` (per-position mean |dlogp| per pair) in ``out``, atomically;
    the PNG only where matplotlib is installed (:func:`kimi_rl_glue.plotting.pyplot`)."""
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f".report.json.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(rep.as_dict(), f, indent=2)
    os.replace(tmp, os.path.join(out, "report.json"))
    from kimi_rl_glue.plotting import pyplot

    plt = pyplot(os.path.join(out, "logprob_diff.png"))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in rep.per_position.items():
        ax.plot(range(len(v)), [max(x, 1e-12) for x in v], label=k, marker=".")
    ax.set_yscale("log")
    ax.set_xlabel("sampled position")
    ax.set_ylabel("mean |logprob difference|")
    ax.set_title("train/rollout logprob difference per position")
    if rep.per_position:
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = os.path.join(out, f".logprob_diff.png.tmp.{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, os.path.join(out, "logprob_diff.png"))
