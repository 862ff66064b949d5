"""Launchers of the fused Triton W4A16 kernels: expert offsets, the grid, the launch plan of :mod:`.plans`, and
the forward's resident-program count that sizes its last-wave split (:mod:`kimi_core.kernels.occupancy`)."""

from __future__ import annotations

import torch

from kimi_core.kernels.device import interpreting, sm_count
from kimi_core.kernels.host_ints import split_pattern
from kimi_core.kernels.w4a16.format_ids import format_id, kernel_format_id
from kimi_core.kernels.w4a16.fused.dgrad import sum_partials_kernel, w4a16_dgrad_kernel, w4a16_dgrad_perm_kernel
from kimi_core.kernels.w4a16.fused.forward import w4a16_fwd_kernel, w4a16_fwd_perm_kernel
from kimi_core.kernels.w4a16.fused.plans import dgrad_config, dgrad_occupancy, fwd_config, fwd_steps, tail_pieces

__all__ = [
    "FWD_SLOTS_PER_SM",
    "as_words",
    "e_pow2",
    "expert_offsets",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "num_programs",
    "sum_partials",
]


def sum_partials(part, out) -> None:
    """``out`` (bf16 ``[T, K]``) = the sum over a split's fp32 partial sums ``part`` (``[split, T, K]``, contiguous):
    :func:`sum_partials_kernel` where ``out`` is contiguous (one pass instead of a reduction and a cast), else
    torch's."""
    if not out.is_contiguous():
        out.copy_(part.sum(0))
        return
    numel = out.numel()
    block = 1024
    sum_partials_kernel[(-(-numel // block),)](part, out, numel, SPLIT=part.shape[0], BLOCK=block, num_warps=4)


def as_words(w_packed):
    """Packed weights as int32 words ``[E, N, K / 8]`` (MXFP4 bytes are reinterpreted, not copied)."""
    if w_packed.dtype == torch.uint8:
        w_packed = w_packed.contiguous().view(torch.int32)
    return w_packed.contiguous()


def expert_offsets(m_splits, num_experts: int, device):
    """``(offsets int32 [E + 1] on device, host splits as a SplitPattern or None)``: host splits' offsets copied once
    per split pattern and device (:meth:`~kimi_core.kernels.host_ints.SplitPattern.device_offsets`); a device tensor's
    summed on the device (no sync)."""
    pattern = split_pattern(m_splits)
    if pattern is not None:
        return pattern.device_offsets(device), pattern
    off = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    torch.cumsum(m_splits.to(device=device, dtype=torch.int32), 0, out=off[1:])
    return off, None


def num_programs(splits, total_rows: int, num_experts: int, block_m: int, num_cols: int) -> int:
    """Programs of a launch: row tiles of ``block_m`` over the experts times ``num_cols`` column tiles."""
    if splits is not None:
        pattern = split_pattern(splits)
        tiles = pattern.row_tiles(block_m)
    else:  # device-side splits: an upper bound; programs past the last tile exit at once
        tiles = (total_rows + block_m - 1) // block_m + num_experts
    return max(tiles, 1) * num_cols


def e_pow2(num_experts: int) -> int:
    """The kernels' vector width over experts: a power of two, at least 16."""
    return max(16, 1 << max(0, num_experts - 1).bit_length())


# resident programs per SM of the compiled forward, per device, constants and specialization (fwd_slots_per_sm)
FWD_SLOTS_PER_SM: dict = {}


def fwd_slots_per_sm(args: tuple, consts: dict, pieces: int = 1, full: int = 0) -> int:
    """Programs of the forward kernel (``w4a16_fwd_perm_kernel`` with ``args`` / ``consts``, unsplit or, ``pieces >
    1``, its last wave's tiles from ``full`` on split in that many; compiled if not yet) resident per SM of the
    current device, as the driver counts them (:mod:`kimi_core.kernels.occupancy`). Cached per device, constants and
    the ints' specialization (Triton's: equal to 1, a multiple of 16), so a shape always splits the same way and its
    results do not depend on what ran before."""
    split = pieces > 1
    ints = tuple((a == 1, a % 16 == 0) for a in (*args, *((full,) if split else ())) if isinstance(a, int))
    key = (torch.cuda.current_device(), ints, tuple(sorted(consts.items())), pieces)
    if key not in FWD_SLOTS_PER_SM:
        from kimi_core.kernels.occupancy import resident_programs

        device = args[0].device
        tail = (
            dict(
                TAIL_SPLIT=pieces,
                full_tiles=full,
                part_ptr=torch.empty(1, device=device),
                count_ptr=torch.zeros(1, dtype=torch.int32, device=device),
            )
            if split
            else {}
        )
        FWD_SLOTS_PER_SM[key] = resident_programs(w4a16_fwd_perm_kernel.warmup(*args, grid=(1,), **tail, **consts))
    return FWD_SLOTS_PER_SM[key]


def size_tail_split(
    programs: int, args: tuple, consts: dict, most: int, steps: int, slots_per_sm: int, device
) -> tuple[int, dict]:
    """``(programs to launch, the split forward's extra arguments)`` for ``programs`` tiles: ``TAIL_SPLIT``,
    ``full_tiles``, the tail tiles' fp32 partial sums ``[tail tiles * TAIL_SPLIT, BLOCK_N, BLOCK_M]`` and zeroed int32
    counters ``[tail tiles]``; ``(programs, {})`` where the last wave is not split (:func:`tail_pieces`).
    ``slots_per_sm`` given (``SLOTS_PER_SM``): that many programs per SM. Else the driver's count for the unsplit kernel
    sizes the split, and the split kernel that picks, which runs every tile of the launch, is counted too: where it
    holds fewer programs per SM nothing splits (docs/performance.md#w4a16-launch-plans)."""
    counted = not slots_per_sm
    if counted:
        slots_per_sm = fwd_slots_per_sm(args, consts)
    full, pieces = tail_pieces(programs, slots_per_sm * sm_count(device), most, steps)
    if pieces == 1 or (counted and fwd_slots_per_sm(args, consts, pieces, full) < slots_per_sm):
        return programs, {}
    n_tail = programs - full
    return full + n_tail * pieces, dict(
        TAIL_SPLIT=pieces,
        full_tiles=full,
        part_ptr=torch.empty(
            (n_tail * pieces, consts["BLOCK_N"], consts["BLOCK_M"]), dtype=torch.float32, device=device
        ),
        count_ptr=torch.zeros(n_tail, dtype=torch.int32, device=device),
    )


def grouped_gemm(x, w_packed, w_scale, fmt, m_splits, config: dict | None = None, out=None, fold_scales: bool = False):
    """Triton forward ``y [T, N]`` bf16; arguments as :func:`kimi_core.kernels.w4a16.w4a16_grouped_gemm` (already
    validated).

    ``config`` overrides the tile choice (benchmarks; ``PERSISTENT``: that many programs per SM walking the tiles,
    experimental; ``ROW_LOADS``: the permuted kernels' weight loads as runs along a row; ``TAIL_SPLIT``, host splits
    only: the last wave's tiles in up to that many pieces, :func:`tail_pieces`, on as many resident programs per SM
    as ``SLOTS_PER_SM`` says, or else as the driver counts for the compiled kernels (:func:`size_tail_split`; on the
    CPU none, so nothing splits); ``K_PAIRS``: the permuted forward's two K steps per iteration where ``K % 256 ==
    0``, its weights always loaded as runs along a row); ``out`` is an optional ``[T, N]`` bf16 output;
    ``fold_scales``: the permuted kernel decodes MXFP4 with one multiply where every scale byte allows it
    (:func:`kimi_core.kernels.w4a16.format_ids.kernel_format_id`; the same bits).
    """
    T, K = x.shape
    E, N = w_packed.shape[0], w_packed.shape[1]
    y = out if out is not None else torch.empty((T, N), dtype=torch.bfloat16, device=x.device)
    if T == 0 or N == 0:
        return y
    offsets, splits = expert_offsets(m_splits, E, x.device)
    cfg = dict(config or fwd_config(T / E, fmt))
    x = x.contiguous()
    ws = w_scale.contiguous()
    fmt_id = format_id(fmt)
    use_asm = not interpreting()
    per_sm = cfg.pop("PERSISTENT", 0)  # experimental (permuted kernel): this many programs per SM walk all the tiles
    row_loads = cfg.pop("ROW_LOADS", False)  # permuted kernel only
    tail_split = cfg.pop("TAIL_SPLIT", 1)  # permuted kernel, one program per tile: see tail_pieces
    slots_per_sm = cfg.pop("SLOTS_PER_SM", 0)
    k_pairs = bool(cfg.pop("K_PAIRS", False)) and K % 256 == 0  # permuted kernel: two K steps per iteration
    if K % 128 == 0 and cfg.pop("PERM", True):
        wq = as_words(w_packed)
        programs = num_programs(splits, T, E, cfg["BLOCK_M"], -(-N // cfg["BLOCK_N"]))
        grid = (min(programs, per_sm * sm_count(x.device)) if per_sm else programs,)
        args = (
            x,
            wq,
            ws,
            y,
            offsets,
            N,
            K,
            E,
            x.stride(0),
            wq.stride(0),
            wq.stride(1),
            ws.stride(0),
            ws.stride(1),
            y.stride(0),
        )
        consts = dict(
            FMT=kernel_format_id(fmt_id, ws, fold_scales),
            GROUP_M=8,
            E_POW2=e_pow2(E),
            USE_ASM=use_asm,
            INTERP=not use_asm,
            PERSISTENT=bool(per_sm),
            ROW_LOADS=bool(row_loads),
            K_PAIRS=k_pairs,
            **cfg,
        )
        tail = {}
        driver_counts = use_asm and x.device.type == "cuda"  # resident programs per SM (else only SLOTS_PER_SM)
        if tail_split > 1 and not per_sm and splits is not None and (slots_per_sm or driver_counts):
            launched, tail = size_tail_split(
                programs, args, consts, tail_split, fwd_steps(K, k_pairs), slots_per_sm, x.device
            )
            grid = (launched,)
        w4a16_fwd_perm_kernel[grid](*args, **tail, **consts)
    else:
        wq = w_packed.contiguous()
        cfg.setdefault("BLOCK_K", 128 if K % 128 == 0 else 32)
        grid = (num_programs(splits, T, E, cfg["BLOCK_M"], -(-N // cfg["BLOCK_N"])),)
        w4a16_fwd_kernel[grid](
            x,
            wq,
            ws,
            y,
            offsets,
            N,
            K,
            E,
            x.stride(0),
            wq.stride(0),
            wq.stride(1),
            ws.stride(0),
            ws.stride(1),
            y.stride(0),
            FMT=fmt_id,
            GROUP_M=8,
            E_POW2=e_pow2(E),
            EVEN_K=K % cfg["BLOCK_K"] == 0,
            INTERP=interpreting(),
            **cfg,
        )
    return y


def grouped_gemm_dgrad(
    dy, w_packed, w_scale, fmt, m_splits, config: dict | None = None, out=None, fold_scales: bool = False
):
    """Triton dgrad ``dx [T, K]`` bf16; arguments as :func:`kimi_core.kernels.w4a16.w4a16_grouped_gemm_dgrad`
    (already validated).

    ``config`` overrides the tile choice (benchmarks; ``SPLIT_N``: the reduction over N in that many ranges);
    ``out`` is an optional ``[T, K]`` bf16 output; ``fold_scales`` as :func:`grouped_gemm`.
    """
    T, N = dy.shape
    E = w_packed.shape[0]
    K = w_scale.shape[2] * 32
    dx = out if out is not None else torch.empty((T, K), dtype=torch.bfloat16, device=dy.device)
    if T == 0 or K == 0:
        return dx
    if N == 0:
        return dx.zero_()
    offsets, splits = expert_offsets(m_splits, E, dy.device)
    cfg = dict(config or dgrad_config(T / E, fmt))
    dy = dy.contiguous()
    ws = w_scale.contiguous()
    fmt_id = format_id(fmt)
    if K % 256 == 0 and cfg.pop("PERM", True):
        wq = as_words(w_packed)
        programs = num_programs(splits, T, E, cfg["BLOCK_M"], K // 256)
        kernel_fmt = kernel_format_id(fmt_id, ws, fold_scales)
        if config is None:
            cfg = dgrad_occupancy(cfg, programs, sm_count(dy.device), kernel_fmt)
        row_loads = cfg.pop("ROW_LOADS", False)
        split = min(cfg.pop("SPLIT_N", 1), -(-N // cfg["BLOCK_N"]))
        # split > 1: fp32 partial sums [split, T, K], summed below; automatic only under 2 programs per SM (64-row
        # tiles) or 8 (16-row tiles), where T * K < 128 * SMs * 256 bounds them
        part = dx if split == 1 else torch.empty((split, T, K), dtype=torch.float32, device=dy.device)
        grid = (programs, split)
        w4a16_dgrad_perm_kernel[grid](
            dy,
            wq,
            ws,
            part,
            offsets,
            N,
            K,
            E,
            dy.stride(0),
            wq.stride(0),
            wq.stride(1),
            ws.stride(0),
            ws.stride(1),
            part.stride(-2),
            FMT=kernel_fmt,
            GROUP_M=8,
            E_POW2=e_pow2(E),
            USE_ASM=not interpreting(),
            EVEN_N=N % cfg["BLOCK_N"] == 0,
            INTERP=interpreting(),
            SPLIT_N=split,
            stride_part=part.stride(0) if split > 1 else 0,
            ROW_LOADS=bool(row_loads),
            **cfg,
        )
        if split > 1:
            sum_partials(part, dx)
    else:
        wq = w_packed.contiguous()
        cfg.pop("ROW_LOADS", None)  # the permuted kernel's option
        cfg.setdefault("BLOCK_K", 128 if K % 128 == 0 else 32)
        grid = (num_programs(splits, T, E, cfg["BLOCK_M"], K // cfg["BLOCK_K"]),)
        w4a16_dgrad_kernel[grid](
            dy,
            wq,
            ws,
            dx,
            offsets,
            N,
            K,
            E,
            dy.stride(0),
            wq.stride(0),
            wq.stride(1),
            ws.stride(0),
            ws.stride(1),
            dx.stride(0),
            FMT=fmt_id,
            GROUP_M=8,
            E_POW2=e_pow2(E),
            EVEN_N=N % cfg["BLOCK_N"] == 0,
            INTERP=interpreting(),
            **cfg,
        )
    return dx
