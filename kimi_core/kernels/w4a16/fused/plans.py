"""Launch plans of the fused Triton W4A16 kernels, as data: tiles by mean tokens per expert, the forward's
last-wave split and the dgrad's split and register cap, with the small functions that read them.

A plan row's value may be a ``{format short name: value}`` dict where MXFP4 and INT4 differ.
``benchmarks/w4a16.py sweep`` times the candidates these tables choose from.
"""

from __future__ import annotations

import math

from kimi_core.kernels.w4a16.format_ids import FMT_MXFP4_FOLDED
from kimi_core.quant.formats import INT4, WeightFormat, weight_format

__all__ = [
    "CAPPED_SPLIT_BELOW_WAVES",
    "CAPPED_SPLIT_N_FEW_PROGRAMS",
    "DGRAD_MAXNREG",
    "DGRAD_PLANS",
    "FWD_PAIR_STEP",
    "FWD_PLANS",
    "FWD_STEP",
    "SPLIT_BELOW_WAVES",
    "SPLIT_N_FEW_PROGRAMS",
    "TAIL_MIN_FILL",
    "dgrad_config",
    "dgrad_occupancy",
    "fwd_config",
    "fwd_steps",
    "tail_pieces",
]

# the permuted forward's reduction step (one decoded [BN, 128] weight tile) and a K_PAIRS loop iteration's two steps
FWD_STEP = 128
FWD_PAIR_STEP = 256

#: (up to this many mean tokens per expert, forward tiles): ROW_LOADS loads a row's weights as one run, K_PAIRS runs
#: two K steps per loop iteration, TAIL_SPLIT splits the last wave's tiles over the reduction (:func:`tail_pieces`).
# measured: docs/performance.md#w4a16-launch-plans
FWD_PLANS: tuple[tuple[float, dict], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, ROW_LOADS=True, TAIL_SPLIT=4, K_PAIRS=True)),
    (32, dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3, ROW_LOADS=True, K_PAIRS=True)),
    (64, dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, ROW_LOADS=True)),
    (math.inf, dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, ROW_LOADS={"mxfp4": True, "int4": False})),
)

#: (up to this many mean tokens per expert, dgrad tiles): BLOCK_N is the reduction step over N.
# measured: docs/performance.md#w4a16-launch-plans
DGRAD_PLANS: tuple[tuple[float, dict], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, ROW_LOADS=True)),
    (32, dict(BLOCK_M=32, BLOCK_N={"mxfp4": 64, "int4": 32}, num_warps=4, num_stages=4, ROW_LOADS=True)),
    (math.inf, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, ROW_LOADS=True)),
)

#: the forward's last wave is split over the reduction only when at least this share of the slots runs it
# measured: docs/performance.md#w4a16-launch-plans
TAIL_MIN_FILL = 0.25

#: under SPLIT_BELOW_WAVES programs per SM the permuted dgrad splits its reduction over N in SPLIT_N_FEW_PROGRAMS
# measured: docs/performance.md#w4a16-launch-plans
SPLIT_BELOW_WAVES = 2
SPLIT_N_FEW_PROGRAMS = 4
#: the 16-row dgrad tile capped at DGRAD_MAXNREG registers (more programs per SM, no spills): split in
#: SPLIT_N_FEW_PROGRAMS up to CAPPED_SPLIT_BELOW_WAVES programs per SM, in CAPPED_SPLIT_N_FEW_PROGRAMS under
#: SPLIT_BELOW_WAVES; above, whole, capped only for folded MXFP4
# measured: docs/performance.md#w4a16-launch-plans
DGRAD_MAXNREG = 96
CAPPED_SPLIT_BELOW_WAVES = 8
CAPPED_SPLIT_N_FEW_PROGRAMS = 2


def _plan_for(plans: tuple[tuple[float, dict], ...], tokens_per_expert: float, fmt) -> dict:
    """The first row of ``plans`` whose bound ``tokens_per_expert`` does not exceed, per-format values resolved
    (``fmt`` a format object or config string; empty: INT4's)."""
    wf: WeightFormat = weight_format(fmt) if fmt else INT4
    plan = next(p for bound, p in plans if tokens_per_expert <= bound)
    return {k: (v[wf.short] if isinstance(v, dict) else v) for k, v in plan.items()}


def fwd_config(tokens_per_expert: float, fmt="") -> dict:
    """Forward tiles for ``tokens_per_expert`` mean rows per expert (:data:`FWD_PLANS`)."""
    return _plan_for(FWD_PLANS, tokens_per_expert, fmt)


def dgrad_config(tokens_per_expert: float, fmt="") -> dict:
    """dgrad tiles for ``tokens_per_expert`` mean rows per expert (:data:`DGRAD_PLANS`)."""
    return _plan_for(DGRAD_PLANS, tokens_per_expert, fmt)


def fwd_steps(K: int, k_pairs: bool) -> int:
    """Loop iterations of the permuted forward over a reduction of ``K``: 128-wide K steps, or pairs of them with
    ``K_PAIRS`` (the units :func:`tail_pieces` cuts a split tile's reduction into)."""
    return K // (FWD_PAIR_STEP if k_pairs else FWD_STEP)


def tail_pieces(programs: int, slots: int, most: int, steps: int) -> tuple[int, int]:
    """``(full, pieces)``: the forward's ``programs`` tiles on ``slots`` resident programs (SMs x programs per SM)
    fill ``programs // slots`` whole waves, the ``full`` first tiles; each of the ``programs - full`` left (the last,
    partly filled wave, or every tile under one wave) runs as ``pieces`` programs over ranges of its ``steps``
    reduction steps, as many as fit in one wave of slots, at most ``most``, none of them empty (1: no split).

    A last wave under :data:`TAIL_MIN_FILL` of the slots is not split: its few tiles run with the whole GPU's memory
    bandwidth to themselves, and the split's partial sums and counters cost more than it saves."""
    n_tail = programs % slots if slots > 0 else 0
    if n_tail == 0 or n_tail < TAIL_MIN_FILL * slots:
        return programs, 1
    pieces = max(1, min(most, slots // n_tail, steps))
    per_piece = -(-steps // pieces)  # whole steps per piece, as the kernel cuts them
    return programs - n_tail, -(-steps // per_piece)  # no empty piece


def dgrad_occupancy(cfg: dict, programs: int, sms: int, kernel_fmt: int) -> dict:
    """The shipped permuted dgrad tile ``cfg`` (:func:`dgrad_config`) for a launch of ``programs`` programs on ``sms``
    SMs decoding ``kernel_fmt`` (:func:`kimi_core.kernels.w4a16.format_ids.kernel_format_id`). Tiles of 32 or more
    rows: under :data:`SPLIT_BELOW_WAVES` programs per SM the reduction over N split in :data:`SPLIT_N_FEW_PROGRAMS`
    ranges of 64 rows, else as they are. The few-token 16-row tile: capped at :data:`DGRAD_MAXNREG` registers and
    split in :data:`CAPPED_SPLIT_N_FEW_PROGRAMS` ranges under :data:`SPLIT_BELOW_WAVES` programs per SM, in
    :data:`SPLIT_N_FEW_PROGRAMS` under :data:`CAPPED_SPLIT_BELOW_WAVES`; above that whole, capped only where the decode
    is folded MXFP4."""
    split = dict(cfg, BLOCK_N=64, SPLIT_N=SPLIT_N_FEW_PROGRAMS)
    if cfg["BLOCK_M"] != 16:
        return split if programs < SPLIT_BELOW_WAVES * sms else cfg
    if programs < SPLIT_BELOW_WAVES * sms:
        return dict(split, SPLIT_N=CAPPED_SPLIT_N_FEW_PROGRAMS, maxnreg=DGRAD_MAXNREG)
    if programs < CAPPED_SPLIT_BELOW_WAVES * sms:
        return dict(split, maxnreg=DGRAD_MAXNREG)
    return dict(cfg, maxnreg=DGRAD_MAXNREG) if kernel_fmt == FMT_MXFP4_FOLDED else cfg
