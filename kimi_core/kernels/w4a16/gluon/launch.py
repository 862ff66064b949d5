"""Launchers of the Gluon W4A16 register kernels: argument checks, the TMA descriptors, the tile table and the grid
(:func:`prepare`), then :func:`grouped_gemm` / :func:`grouped_gemm_dgrad`.

Shapes and dtypes: ``x`` bf16 ``[T, K]`` with rows sorted by expert; ``w_packed`` ``[E, N, K/2]`` uint8 (MXFP4,
element ``2j`` in the low nibble) or ``[E, N, K/8]`` int32 (INT4, element ``8m + j`` in nibble ``j``: the same
bytes); ``w_scale`` ``[E, N, K/32]`` uint8 E8M0 or bf16; ``y`` bf16 ``[T, N]`` (dgrad: ``dy`` ``[T, N]`` -> ``dx``
``[T, K]``). Extra memory: the output, the tile table (kept per split pattern) and, kept per weight, the dgrad's
transposed scales and, where a scale row is no multiple of 16 bytes, the forward's padded scales.
"""

from __future__ import annotations

import dataclasses

import torch

from kimi_core.kernels.device import device_capability
from kimi_core.kernels.host_ints import split_pattern
from kimi_core.kernels.w4a16.derived import derived
from kimi_core.kernels.w4a16.format_ids import format_id, kernel_format_id
from kimi_core.kernels.w4a16.gluon.pipeline import HAVE_GLUON
from kimi_core.kernels.w4a16.gluon.tiles import (
    BK,
    BLOCK_N_CHOICES,
    BM,
    CONSUMER_REGS,
    MAX_LOAD_STAGES,
    block_m_choices,
    default_load_stages,
    pick_block_m,
    programs,
    resolve_columns,
    shape_fits,
    tile_table,
)
from kimi_core.kernels.w4a16.operands import check_operands

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kimi_core.kernels.w4a16.gluon.register_kernel import w4a16_rs_kernel

__all__ = ["Launch", "descriptor_blocks", "grouped_gemm", "grouped_gemm_dgrad", "prepare"]

WHERE = "kimi_core.kernels.w4a16.gluon"


def descriptor_blocks(dgrad: bool, block_m: int, scale_bytes: int, block_n: int) -> tuple[list[int], ...]:
    """TMA block shapes ``(activation, packed bytes, scales)``. Forward: ``[block_m, BK]``, ``[block_n, BK / 2]``
    and ``[block_n, 16 / scale_bytes]`` (16 bytes per row, TMA's narrowest, of which a step uses ``BK / 32``
    groups). dgrad (scales transposed to ``[E * K / 32, N]``): ``[block_m, BK]``, the bytes as two ``[BK, block_n /
    4]`` boxes (one per consumer warpgroup; a slice of one swizzled box along its rows is not allowed) and
    ``[block_n / 32, BK]``, exactly the step's groups."""
    if dgrad:
        return [block_m, BK], [BK, block_n // 4], [block_n // 32, BK]
    return [block_m, BK], [block_n, BK // 2], [block_n, 16 // scale_bytes]


def scale_smem_layout(s_block: list[int], scale_bytes: int, dgrad: bool):
    """Shared-memory layout of a scale box: the default swizzle, or none for the dgrad's transposed scales (each
    consumer warpgroup reads its own rows of the ``[block_n / 32, BK]`` box, a slice a swizzled box does not
    allow)."""
    if dgrad:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * scale_bytes, rank=2)
    return gl.NVMMASharedLayout.get_default_for(s_block, gl.uint8 if scale_bytes == 1 else gl.bfloat16)


def forward_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """The forward's scales ``[E * N, K / 32]`` (``w_scale`` ``[E, N, K / 32]``, contiguous): a view where a row is a
    multiple of 16 bytes (TMA's stride), else a view of a copy whose rows are padded to 16 bytes (zeros, past the
    ``K / 32`` groups a step reads), made once per weight and version (:func:`..derived.derived`)."""
    E, N, G = w_scale.shape
    unit = 16 // w_scale.element_size()  # scales per 16 bytes
    if G % unit == 0:
        return w_scale.reshape(E * N, G)

    def padded(w: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros((E * N, -(-G // unit) * unit), dtype=w.dtype, device=w.device)
        rows[:, :G].copy_(w.reshape(E * N, G))
        return rows[:, :G]

    return derived(w_scale, "gluon_forward_scales", padded)


def dgrad_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """The dgrad's scales transposed, ``[E * K / 32, N]`` (``w_scale`` ``[E, N, K / 32]``, contiguous): each kw
    group's scales along n, one TMA box per step; rows padded to 16 bytes for TMA (the box past N zero-filled: a
    finite scale, whose weights meet dy's zero fill). Made by :mod:`kimi_core.kernels.transpose` (tiled: coalesced
    both ways) once per weight and version (:func:`..derived.derived`)."""
    E, N, G = w_scale.shape

    def transposed(w: torch.Tensor) -> torch.Tensor:
        from kimi_core.kernels.transpose import transpose_last_two

        pad = -N % (16 // w.element_size())
        scales = torch.empty((E * G, N + pad), dtype=w.dtype, device=w.device)[:, :N]
        transpose_last_two(w, scales.view(E, G, N))
        return scales

    return derived(w_scale, "gluon_dgrad_scales", transposed)


def weight_descriptors(w_packed: torch.Tensor, w_scale: torch.Tensor, dgrad: bool, p_block: list, s_block: list):
    """TMA descriptors ``(packed bytes, scales)`` of one weight in the boxes ``p_block`` / ``s_block``
    (:func:`descriptor_blocks`): the packed bytes ``[E * N, K / 2]`` (INT4 words are the same bytes) and the scales of
    :func:`dgrad_scales` / :func:`forward_scales`; kept per weight, version and boxes (:func:`..derived.derived`)."""
    E, N, G = w_scale.shape
    scale_bytes = w_scale.element_size()

    def packed_desc(w: torch.Tensor):
        packed = w.view(torch.uint8).reshape(E * N, G * 16)
        return TensorDescriptor.from_tensor(packed, p_block, gl.NVMMASharedLayout.get_default_for(p_block, gl.uint8))

    def scale_desc(w: torch.Tensor):
        scales = dgrad_scales(w) if dgrad else forward_scales(w)
        return TensorDescriptor.from_tensor(scales, s_block, scale_smem_layout(s_block, scale_bytes, dgrad))

    return (
        derived(w_packed, f"gluon_packed_desc_{p_block}", packed_desc),
        derived(w_scale, f"gluon_scale_desc_{'dgrad' if dgrad else 'fwd'}_{s_block}", scale_desc),
    )


@dataclasses.dataclass
class Launch:
    """What a Gluon W4A16 kernel is launched with, once the arguments are checked (:func:`prepare`): the output,
    the TMA descriptors of the activation, packed bytes and scales, the tile table and the work-item grid (device
    splits: a table sized for the most tiles, :attr:`n_tiles` and the grid sized for it, and the real row-tile count
    on the device in :attr:`tile_count`, which the kernel reads);
    no tile table (:attr:`empty`): nothing to compute (no rows or no output columns), ``out`` is returned as it is."""

    out: torch.Tensor
    descs: tuple = ()
    tiles: torch.Tensor | None = None
    tile_count: torch.Tensor | None = None
    n_tiles: int = 0
    n_col_tiles: int = 0
    N: int = 0
    K: int = 0
    block_m: int = BM
    stages: int = 2
    grid: tuple = (0,)
    fmt_id: int = 0

    @property
    def empty(self) -> bool:
        return self.tiles is None


def prepare(
    a,
    w_packed,
    w_scale,
    fmt,
    m_splits,
    out,
    dgrad: bool,
    where: str,
    block_m: int,
    block_n: int,
    stages: int | None,
    persistent: bool | int,
) -> Launch:
    """Check one call's arguments (``where`` names the entry point in errors) and build its :class:`Launch`;
    ``stages`` None: :func:`.tiles.default_load_stages`. The scales go as :func:`forward_scales` /
    :func:`dgrad_scales` (the dgrad's a transposed copy ``[E * K / 32, N]``, 1/16 of the packed bytes, made once per
    weight)."""
    if not HAVE_GLUON:
        raise RuntimeError(f"{where} needs Triton >= 3.5 (triton.experimental.gluon)")
    E, N, K, m_splits = check_operands(
        a, "dy" if dgrad else "x", w_packed, w_scale, fmt, m_splits, "N" if dgrad else "K"
    )
    scale_bytes = w_scale.element_size()
    if not shape_fits(N, K):
        raise ValueError(
            f"{where}: needs K a multiple of {BK} (whole K steps) and N of 8 (TMA rows of 16 bytes for dy), "
            f"got K={K}, N={N}"
        )
    choices = block_m_choices(block_n)
    if block_m not in choices:
        raise ValueError(f"{where}: block_m must be one of {choices}, got {block_m}")
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"{where}: block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")
    stages = default_load_stages(block_m, block_n, dgrad) if stages is None else stages
    if not 2 <= stages <= MAX_LOAD_STAGES:
        raise ValueError(f"{where}: load_stages must be 2 to {MAX_LOAD_STAGES}, got {stages}")
    if a.device.type != "cuda":
        raise RuntimeError(f"{where}: runs on Hopper GPUs only (wgmma, TMA); {'dy' if dgrad else 'x'} is on {a.device}")
    if device_capability(a.device)[0] != 9:
        raise RuntimeError(
            f"{where}: runs on Hopper GPUs only (wgmma, TMA); {a.device} has compute capability "
            f"{device_capability(a.device)}"
        )
    out_cols = K if dgrad else N
    if isinstance(m_splits, torch.Tensor):  # device splits: the table built on the GPU, its count read there too
        from kimi_core.kernels.w4a16.gluon.device_tiles import device_tile_table

        tiles, tile_count = device_tile_table(m_splits, block_m, a.shape[0], a.device)
    else:
        tiles, tile_count = tile_table(m_splits, block_m, a.device), None
    y = torch.empty((a.shape[0], out_cols), dtype=torch.bfloat16, device=a.device) if out is None else out
    if tiles.shape[0] == 0 or out_cols == 0:
        return Launch(out=y)
    a = a.contiguous()
    a_block, p_block, s_block = descriptor_blocks(dgrad, block_m, scale_bytes, block_n)
    descs = (
        TensorDescriptor.from_tensor(a, a_block, gl.NVMMASharedLayout.get_default_for(a_block, gl.bfloat16)),
        *weight_descriptors(w_packed.contiguous(), w_scale.contiguous(), dgrad, p_block, s_block),
    )
    n_col_tiles = -(-out_cols // block_n)
    n_tiles = n_col_tiles * tiles.shape[0]
    return Launch(
        out=y,
        descs=descs,
        tiles=tiles,
        tile_count=tile_count,
        n_tiles=n_tiles,
        n_col_tiles=n_col_tiles,
        N=N,
        K=K,
        block_m=block_m,
        stages=stages,
        grid=(programs(n_tiles, persistent, a.device),),
        fmt_id=format_id(fmt),
    )


def _run(
    a,
    w_packed,
    w_scale,
    fmt,
    m_splits,
    out,
    dgrad: bool,
    block_m: int | None,
    block_n: int | None,
    load_stages: int | None,
    persistent: bool | int,
    decode_ahead: bool | str,
    fold_scales: bool,
) -> torch.Tensor:
    where = f"{WHERE}.{'grouped_gemm_dgrad' if dgrad else 'grouped_gemm'}"
    pattern = split_pattern(m_splits)  # host splits read once; their tables cached per pattern
    m_splits = pattern if pattern is not None else m_splits
    # the tile picks' mean rows per expert: the non-empty experts' (host splits), else T / E (device splits: no sync)
    rows = pattern if pattern is not None else a.shape[0] / max(1, m_splits.numel())
    block_n, decode_ahead = resolve_columns(where, rows, block_n, decode_ahead)
    if decode_ahead and block_n != 128:
        raise ValueError(
            f"{where}: decode_ahead runs on 128-column tiles (two fragments in registers), got block_n {block_n}"
        )
    block_m = pick_block_m(rows, block_n) if block_m is None else block_m
    run = prepare(a, w_packed, w_scale, fmt, m_splits, out, dgrad, where, block_m, block_n, load_stages, persistent)
    if run.empty:
        return run.out
    kernel_fmt = kernel_format_id(run.fmt_id, w_scale, fold_scales)
    w4a16_rs_kernel[run.grid](
        *run.descs,
        run.out,
        run.tiles,
        run.tile_count if run.tile_count is not None else run.tiles,
        run.n_tiles,
        run.n_col_tiles,
        run.N,
        run.K,
        run.out.stride(0),
        kernel_fmt,
        run.block_m,
        block_n,
        BK,
        run.stages,
        CONSUMER_REGS,
        decode_ahead,
        dgrad,
        run.tile_count is not None,
        num_warps=4,
    )
    return run.out


def grouped_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt,
    m_splits,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    load_stages: int | None = None,
    persistent: bool | int = False,
    decode_ahead: bool | str = False,
    fold_scales: bool = False,
) -> torch.Tensor:
    """``y[T, N]`` bf16, ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` with fp32 accumulation, for ``fmt``
    :data:`kimi_core.quant.formats.MXFP4` / ``INT4`` (inputs checked as the public ops check them). Needs a Hopper
    GPU and Triton with Gluon; ``K`` a multiple of 64, ``N`` of 8 (:func:`.tiles.shape_fits`); host ``m_splits``
    are read once per call (tables cached per pattern); a device tensor is never read back (the tile table built on
    the GPU, :mod:`.device_tiles`; the tile picks from ``T / E``): no host sync, capturable in a CUDA graph.

    :param out: a bf16 ``[T, N]`` to write into.
    :param block_n: output columns per tile, 256 or 128 (default :func:`.tiles.pick_block_n`).
    :param block_m: rows per tile, one of :func:`.tiles.block_m_choices` (default :func:`.tiles.pick_block_m`).
    :param load_stages: TMA ring depth (default :func:`.tiles.default_load_stages`).
    :param persistent: one program per SM (or that many programs) walks the tiles, the rings running on from one
        tile to the next (:func:`.tiles.programs`).
    :param decode_ahead: each warpgroup decodes step ``i + 1`` while its step-``i`` wgmma runs (128-column tiles);
        ``"auto"``: wherever the tiles have 128 columns.
    :param fold_scales: MXFP4 decoded with one multiply where every scale allows it
        (:func:`kimi_core.kernels.w4a16.format_ids.kernel_format_id`; the same bits).
    """
    return _run(
        x,
        w_packed,
        w_scale,
        fmt,
        m_splits,
        out,
        False,
        block_m,
        block_n,
        load_stages,
        persistent,
        decode_ahead,
        fold_scales,
    )


def grouped_gemm_dgrad(
    dy: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    fmt,
    m_splits,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    load_stages: int | None = None,
    persistent: bool | int = False,
    decode_ahead: bool | str = False,
    fold_scales: bool = False,
) -> torch.Tensor:
    """``dx[T, K]`` bf16, ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` with fp32 accumulation (``dy`` bf16 ``[T,
    N]``), the weights decoded into the wgmma's register A fragment as ``W^T`` (``K`` output columns x ``N``); the
    scales go as a transposed copy ``[E * K / 32, N]`` made once per weight and version (:func:`dgrad_scales`, 1/16
    of the packed bytes). Arguments as :func:`grouped_gemm`."""
    return _run(
        dy,
        w_packed,
        w_scale,
        fmt,
        m_splits,
        out,
        True,
        block_m,
        block_n,
        load_stages,
        persistent,
        decode_ahead,
        fold_scales,
    )
