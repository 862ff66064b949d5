"""Host-side tile choices of the Gluon W4A16 register kernels (:mod:`.register_kernel`): the compiled tile sizes,
the picks by mean rows per expert, the tile table, the ring depth and the shapes the kernels take.

A work item is (``block_n`` output columns, up to ``block_m`` rows of one expert). No Triton import here, so the
dispatcher and the tests read these on any machine.
"""

from __future__ import annotations

import numpy as np
import torch

from kimi_core.kernels.host_ints import SplitPattern, int32_on, split_pattern

__all__ = [
    "BK",
    "BLOCK_M_CHOICES",
    "BLOCK_N_CHOICES",
    "BM",
    "CONSUMER_REGS",
    "MAX_LOAD_STAGES",
    "RING_BUDGET",
    "ahead_where_it_fits",
    "block_m_choices",
    "default_load_stages",
    "load_stage_bytes",
    "mean_rows",
    "pick_block_m",
    "pick_block_n",
    "programs",
    "resolve_columns",
    "shape_fits",
    "tile_table",
]

BM, BK = 128, 64  # BM: rows of one expert per tile at 256 columns (fewer where experts have few rows); BK: K step
BLOCK_M_CHOICES = (8, 16, 32, 64, 128)  # activation rows per tile: the wgmma's N (see pick_block_m)
BLOCK_N_CHOICES = (128, 256)  # output columns per tile: two warpgroups of 64 or of 128 weight rows (the wgmma's M)
MAX_LOAD_STAGES = 8  # TMA ring depth cap (activation tile + packed bytes + scales per stage)
RING_BUDGET = 200 * 1024  # shared bytes for the rings; the epilogue's scratch and the barriers take the rest of 227 KB
CONSUMER_REGS = 232  # per thread of each consumer warpgroup: 128 accumulator registers, the fragment, the decode


def load_stage_bytes(block_m: int, dgrad: bool, block_n: int, scales_t: bool = False) -> int:
    """Shared bytes of one TMA ring stage: the bf16 activation tile, the packed bytes and the 16-byte scale boxes
    (``scales_t``: the ``[block_n / 32, BK]`` box of transposed scales, at most 2 bytes each)."""
    scales = block_n // 32 * BK * 2 if scales_t else (BK if dgrad else block_n) * 16
    return block_m * BK * 2 + block_n * BK // 2 + scales


def default_load_stages(block_m: int, block_n: int, dgrad: bool = False) -> int:
    """Depth of the TMA rings (2 to :data:`MAX_LOAD_STAGES`): as many stages of activation tile, packed bytes and
    scale box of a ``block_n``-column tile as fit :data:`RING_BUDGET`; ``dgrad``: the dgrad stages (transposed
    scales). A stage is released only when its wgmma has retired, so the loads lead the MMA by ``stages - 1``."""
    return max(2, min(MAX_LOAD_STAGES, RING_BUDGET // load_stage_bytes(block_m, dgrad, block_n, scales_t=dgrad)))


def mean_rows(m_splits) -> float:
    """Mean rows of the non-empty experts (0 when every expert is empty); host splits (a list, a CPU tensor or a
    :class:`~kimi_core.kernels.host_ints.SplitPattern`) cached per pattern, a device tensor read back (a sync); a
    number is taken as the mean already known (the launcher's ``T / E`` for device splits: no sync)."""
    if isinstance(m_splits, (int, float)):
        return float(m_splits)
    pattern = split_pattern(m_splits)
    return (pattern if pattern is not None else split_pattern(m_splits.cpu())).busy_mean()


def block_m_choices(block_n: int) -> tuple[int, ...]:
    """Activation rows per tile (the wgmma's N side) with ``block_n`` output columns: up to 128 with 256 columns
    (a warpgroup's ``[128, 128]`` fp32 accumulator is 128 registers per thread), up to 256 with 128 columns
    (``[64, 256]``, the same 128 registers). 256 rows halve the decode per multiply-add: each decoded weight meets
    256 rows instead of 128."""
    return BLOCK_M_CHOICES + ((256,) if block_n == 128 else ())


def pick_block_n(m_splits) -> int:
    """Output columns per tile: 128 (then 256 rows per tile, :func:`pick_block_m`) where the non-empty experts' mean
    rows exceed 128, else 256."""
    # measured: docs/performance.md#w4a16-launch-plans
    return 128 if mean_rows(m_splits) > BM else 256


def pick_block_m(m_splits, block_n: int) -> int:
    """Activation rows per tile: 256 with ``block_n`` 128 where the non-empty experts' mean rows exceed 128; else the
    smallest of :data:`BLOCK_M_CHOICES` at or above that mean, 128 above it (or when all are empty), so a tile of an
    expert with few rows reads and multiplies about the rows it has."""
    mean = mean_rows(m_splits)
    if block_n == 128 and mean > BM:
        return 256
    return next((b for b in BLOCK_M_CHOICES if b >= (mean or BM)), BM)


def ahead_where_it_fits(block_n: int) -> bool:
    """``decode_ahead="auto"``: decode ahead wherever it compiles, i.e. 128-column tiles (two fragments in
    registers); 256-column tiles have no room for a second fragment."""
    # measured: docs/performance.md#w4a16-launch-plans
    return block_n == 128


def resolve_columns(where: str, m_splits, block_n: int | None, decode_ahead: bool | str) -> tuple[int, bool]:
    """``(block_n, decode_ahead)`` of one call: ``decode_ahead="auto"`` -> :func:`ahead_where_it_fits` on the
    columns asked for or picked (:func:`pick_block_n`); ``block_n`` None -> 128 under decode ahead, else
    :func:`pick_block_n`; a ``block_n`` not in :data:`BLOCK_N_CHOICES` is refused by name (``where``)."""
    if decode_ahead == "auto":
        block_n = pick_block_n(m_splits) if block_n is None else block_n
        decode_ahead = ahead_where_it_fits(block_n)
    block_n = (128 if decode_ahead else pick_block_n(m_splits)) if block_n is None else block_n
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"{where}: block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")
    return block_n, bool(decode_ahead)


def tile_rows(pattern: SplitPattern, block_m: int) -> torch.Tensor:
    """int32 ``[tiles, 3]`` on the CPU: rows (expert, first row, end row) covering each expert's rows in ``block_m``
    steps, experts in order; empty experts get no tile. Vectorized (numpy: a few microseconds, no Python loop over
    the tiles)."""
    m = np.asarray(pattern, dtype=np.int64).reshape(-1)
    n = (m + block_m - 1) // block_m  # tiles per expert
    expert = np.repeat(np.arange(m.size, dtype=np.int64), n)
    off = np.asarray(pattern.offsets, dtype=np.int64)
    first_tile = np.cumsum(n) - n
    row0 = off[:-1][expert] + (np.arange(expert.size, dtype=np.int64) - first_tile[expert]) * block_m
    return torch.from_numpy(np.stack([expert, row0, off[1:][expert]], 1).astype(np.int32))


def tile_table(m_splits, block_m: int, device) -> torch.Tensor:
    """``[tiles, 3]`` int32 rows (expert, first row, end row) on ``device`` covering each expert's rows in ``block_m``
    steps (:func:`tile_rows`); empty experts get no tile. Host splits: built and copied once per split pattern,
    ``block_m`` and device; a device tensor is read back (a sync)."""
    pattern = split_pattern(m_splits)
    if pattern is None:
        pattern = split_pattern(m_splits.cpu())
    device = torch.device(device)
    return pattern.table(
        ("gluon_tiles", block_m, device), lambda: int32_on(tile_rows(pattern, block_m), device), device
    )


def shape_fits(N: int, K: int) -> bool:
    """Whether the Gluon kernels take ``[N, K]`` experts in either format: ``K`` a multiple of :data:`BK` (whole K
    steps) and ``N`` of 8 (16-byte rows of ``dy`` for TMA). Scale rows that are no multiple of 16 bytes (MXFP4 ``K``
    no multiple of 512, INT4 of 256) go to the forward as a padded copy made once per weight
    (:func:`.launch.forward_scales`); the dgrad's transposed scales are padded anyway."""
    return not (K % BK or N % 8)


def programs(n_tiles: int, persistent: bool | int, device) -> int:
    """Programs to launch for ``n_tiles`` work items: one each (``persistent=False``), one per SM (``True``: the
    rings and the partitions' registers fill an SM, so one program runs per SM either way), or that many (an
    ``int``, e.g. for tests whose few tiles would otherwise give each program one); never more than ``n_tiles``."""
    if persistent is False:
        return n_tiles
    if persistent is True:
        from kimi_core.kernels.device import sm_count

        persistent = sm_count(device)
    if persistent < 1:
        raise ValueError(
            f"kimi_core/kernels/w4a16/gluon: persistent must be a bool or a positive number of programs, "
            f"got {persistent}"
        )
    return min(n_tiles, persistent)
