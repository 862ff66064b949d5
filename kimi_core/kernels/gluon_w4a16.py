"""EXPERIMENTAL (issue #21, not dispatched): a warp-specialised W4A16 grouped GEMM (forward and dgrad) in Gluon.

The fused Triton kernel (:mod:`.triton_w4a16`) decodes each 4-bit weight tile in the same warps that then
wait on its wgmma, so decode and MMA never overlap (340-390 TFLOP/s on K3 fc1 against BF16's ~700). Here
the two run in different warps of one CTA (Gluon's ``warp_specialize``):

* the **producer** partition (4 warps) loads a ``[BM, BK]`` tile of the activations (``x``, or ``dy`` for dgrad,
  whose contraction runs over ``N``) and decodes the matching weight tile (``[BN, BK]``, or ``[BK, BN]`` for dgrad)
  of the expert (MXFP4: E2M1 codes x E8M0 group scales; INT4: offset-binary nibbles x bf16 group scales,
  the same exact arithmetic as :func:`kimi_core.quant.dequantize`), writes both into stage ``s`` of a
  ``STAGES``-deep shared-memory ring and arrives on ``ready[s]``;
* the **consumer** (default partition, one warpgroup) waits ``ready[s]``, runs ``warpgroup_mma`` from shared
  memory into an fp32 accumulator, and once that wgmma has retired arrives on ``empty[s]``, which the producer
  waits on before it refills the stage.

Shapes and dtypes: ``x`` bf16 ``[T, K]`` with rows sorted by expert; ``w_packed`` ``[E, N, K/2]`` uint8 (MXFP4,
element ``2j`` in the low nibble) or ``[E, N, K/8]`` int32 (INT4, element ``8m + j`` in nibble ``j``); ``w_scale``
``[E, N, K/32]`` uint8 E8M0 or bf16; ``y`` bf16 ``[T, N]`` (dgrad: ``dy`` ``[T, N]`` -> ``dx`` ``[T, K]``). One
program per (``BN`` output columns, ``BM`` rows of one expert), from a host-built tile table ``[tiles, 3]`` int32 =
(expert, first row, end row).

Status (2026-12-03): compiles for sm_90a with Triton 3.6.0 on the CPU
(``tests/gpu/gluon_sm90_compile_check.py``); not yet run on a GPU. Its GPU test
(``tests/kimi_core/kernels/test_gluon_w4a16_gpu.py``) checks it against the float32 oracle of exactly
dequantized weights. Until that passes
and ``benchmarks/w4a16_grouped_gemm.py`` shows it faster, :func:`kimi_core.kernels.choose_path` never picks it.
"""

from __future__ import annotations

import torch

try:  # Triton >= 3.5 ships Gluon; older Tritons (and CPU-only installs) have no such module
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "tile_table", "grouped_gemm", "grouped_gemm_dgrad"]

BM, BN, BK, STAGES = 64, 128, 64, 3
# FMT: triton_w4a16's format ids (FMT_MXFP4 = 0, FMT_INT4 = 1, from its _fmt_id)


def tile_table(m_splits, block_m: int, device) -> torch.Tensor:
    """``[tiles, 3]`` int32 rows (expert, first row, end row) covering each expert's rows in ``block_m`` steps;
    empty experts get no tile. ``m_splits`` is read on the host."""
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
    rows, start = [], 0
    for e, m in enumerate(int(v) for v in splits):
        rows += [(e, r, start + m) for r in range(start, start + m, block_m)]
        start += m
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 3)


if HAVE_GLUON:

    @gluon.jit
    def _code_value(nib, FMT: gl.constexpr):
        """4-bit codes (int32, 0..15) -> fp32: E2M1 ``(1 + m/2) * 2^(e-1)`` (``e = 0``: ``m/2``) or ``nib - 8``;
        the arithmetic of :func:`.triton_w4a16._code_value`, restated because Gluon cannot call Triton JIT code."""
        if FMT == 0:
            mag = nib & 0x7
            ex = mag >> 1
            normal = ((ex + 126) << 23) | ((mag & 1) << 22)
            v = gl.where(ex == 0, (mag & 1).to(gl.float32) * 0.5, normal.to(gl.float32, bitcast=True))
            return gl.where((nib & 0x8) != 0, -v, v)
        else:
            return (nib - 8).to(gl.float32)

    @gluon.jit
    def _decode_tile(wq_ptr, ws_ptr, expert, ns, ks, N, K, stride_we, stride_wn, stride_se, stride_sn,
                     FMT: gl.constexpr):
        """bf16 ``[len(ns), len(ks)]``: expert ``expert``'s weight ``W[ns, ks]`` (``ns`` along dim 0, ``ks`` along
        dim 1 of one blocked layout); entries past ``N`` rows or ``K`` columns read as 0."""
        mask = (ns < N)[:, None] & (ks < K)[None, :]
        expert = expert.to(gl.int64)  # expert * stride_we passes 2^31 bytes on real widths
        if FMT == 0:
            byte = gl.load(wq_ptr + expert * stride_we + ns[:, None] * stride_wn + (ks // 2)[None, :], mask=mask,
                           other=0).to(gl.int32) & 0xFF
            nib = (byte >> ((ks & 1) * 4)[None, :]) & 0xF
            sb = gl.load(ws_ptr + expert * stride_se + ns[:, None] * stride_sn + (ks // 32)[None, :], mask=mask,
                         other=0).to(gl.int32) & 0xFF
            scale = gl.where(sb == 0, 0x00400000, sb << 23).to(gl.float32, bitcast=True)  # 2^(s - 127)
        else:
            word = gl.load(wq_ptr + expert * stride_we + ns[:, None] * stride_wn + (ks // 8)[None, :], mask=mask,
                           other=0)
            nib = (word >> ((ks & 7) * 4)[None, :]) & 0xF
            scale = gl.load(ws_ptr + expert * stride_se + ns[:, None] * stride_sn + (ks // 32)[None, :], mask=mask,
                            other=0.0).to(gl.float32)
        return (_code_value(nib, FMT) * scale).to(gl.bfloat16)

    @gluon.jit
    def _producer(a_ptr, wq_ptr, ws_ptr, a_ring, w_ring, ready, empty, expert, row0, row_end, col0, N, K,
                  stride_am, stride_we, stride_wn, stride_se, stride_sn, FMT: gl.constexpr, DGRAD: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """Per step ``i`` (``BK`` of the contraction): ``a[rows, step]`` into ``a_ring[s]`` and the weight tile into
        ``w_ring[s]``: ``W[cols, step]`` ``[BN, BK]`` (forward) or ``W[step, cols]`` ``[BK, BN]`` (dgrad)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        step = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))  # contraction offsets, as a tile's columns
        if DGRAD:
            extent = N
            step_rows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))  # ... and as a tile's rows
            cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        else:
            extent = K
            cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        for i in range(gl.cdiv(extent, BK)):
            s = i % STAGES
            # stage s is free once the consumer's wgmma of step i - STAGES retired (a fresh barrier passes parity 1)
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            c = i * BK + step
            a = gl.load(a_ptr + rows.to(gl.int64)[:, None] * stride_am + c[None, :],
                        mask=(rows < row_end)[:, None] & (c < extent)[None, :], other=0.0)
            a_ring.index(s).store(a)
            if DGRAD:
                w = _decode_tile(wq_ptr, ws_ptr, expert, i * BK + step_rows, cols, N, K, stride_we, stride_wn,
                                 stride_se, stride_sn, FMT)
            else:
                w = _decode_tile(wq_ptr, ws_ptr, expert, cols, c, N, K, stride_we, stride_wn, stride_se, stride_sn,
                                 FMT)
            w_ring.index(s).store(w)
            fence_async_shared()  # the generic-proxy stores before the async-proxy (wgmma) reads
            mbarrier.arrive(ready.index(s), count=1)

    @gluon.jit
    def _consumer(a_ring, w_ring, ready, empty, out_ptr, row0, row_end, col0, steps, out_cols, stride_om,
                  DGRAD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if DGRAD:
                acc = warpgroup_mma(a_ring.index(s), w_ring.index(s), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_ring.index(s), w_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step i - 1's wgmma has retired
            if i > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # epilogue here (Triton 3.6's warp_specialize cannot return the default partition's tensors)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], out,
                 mask=(rows < row_end)[:, None] & (cols < out_cols)[None, :])

    @gluon.jit
    def w4a16_ws_kernel(a_ptr, wq_ptr, ws_ptr, out_ptr, tiles_ptr, N, K,
                        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                        FMT: gl.constexpr, DGRAD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                        BK: gl.constexpr, STAGES: gl.constexpr):
        """Forward (``a = x [T, K]``, ``out = y [T, N]``) or dgrad (``a = dy [T, N]``, ``out = dx [T, K]``) of
        one ``[BM, BN]`` output tile: program (column tile, row tile of one expert)."""
        col0 = gl.program_id(0) * BN
        tile = gl.program_id(1)
        expert = gl.load(tiles_ptr + tile * 3)
        row0 = gl.load(tiles_ptr + tile * 3 + 1)
        row_end = gl.load(tiles_ptr + tile * 3 + 2)

        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK],
                                           gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
        if DGRAD:
            w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN],
                                               gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))
            steps = gl.cdiv(N, BK)
            out_cols = K
        else:
            w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK],
                                               gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
            steps = gl.cdiv(K, BK)
            out_cols = N
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)

        gl.warp_specialize([
            (_consumer, (a_ring, w_ring, ready, empty, out_ptr, row0, row_end, col0, steps, out_cols, stride_om,
                         DGRAD, BM, BN, BK, STAGES)),
            (_producer, (a_ptr, wq_ptr, ws_ptr, a_ring, w_ring, ready, empty, expert, row0, row_end, col0, N, K,
                         stride_am, stride_we, stride_wn, stride_se, stride_sn, FMT, DGRAD, BM, BN, BK, STAGES)),
        ], [4], [128])


def _launch(a, w_packed, w_scale, fmt: str, m_splits, out, dgrad: bool, where: str) -> torch.Tensor:
    from kimi_core.kernels import _validate
    from kimi_core.kernels.triton_w4a16 import _fmt_id

    if not HAVE_GLUON:
        raise RuntimeError("kimi_core.kernels.gluon_w4a16 needs Triton >= 3.5 (triton.experimental.gluon)")
    E, N, K = _validate(a, "dy" if dgrad else "x", w_packed, w_scale, fmt, m_splits, "N" if dgrad else "K")
    if K % BK:
        raise ValueError(f"gluon_w4a16.{where}: K={K} is not a multiple of {BK}")
    out_cols = K if dgrad else N
    tiles = tile_table(m_splits, BM, a.device)
    y = torch.empty((a.shape[0], out_cols), dtype=torch.bfloat16, device=a.device) if out is None else out
    if tiles.shape[0] == 0 or out_cols == 0:
        return y
    a, w_packed, w_scale = a.contiguous(), w_packed.contiguous(), w_scale.contiguous()
    grid = (-(-out_cols // BN), tiles.shape[0])
    w4a16_ws_kernel[grid](a, w_packed, w_scale, y, tiles, N, K, a.stride(0), w_packed.stride(0), w_packed.stride(1),
                          w_scale.stride(0), w_scale.stride(1), y.stride(0), _fmt_id(fmt), dgrad, BM, BN, BK, STAGES,
                          num_warps=4)
    return y


def grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[T, N]`` bf16, ``y[rows_e] = x[rows_e] . dequant(W_e)^T`` with fp32 accumulation, for ``fmt`` one of
    :data:`kimi_core.kernels.MXFP4_FORMAT` / ``INT4_FORMAT`` (layouts in the module docstring; inputs checked as
    :func:`kimi_core.kernels.w4a16_grouped_gemm` checks them). Needs a Hopper GPU and Triton with Gluon; ``K`` a
    multiple of 64; ``m_splits`` is read on the host; ``out``: a bf16 ``[T, N]`` to write into."""
    return _launch(x, w_packed, w_scale, fmt, m_splits, out, False, "grouped_gemm")


def grouped_gemm_dgrad(dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str, m_splits,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``dx[T, K]`` bf16, ``dx[rows_e] = dy[rows_e] . dequant(W_e)`` with fp32 accumulation (``dy`` bf16
    ``[T, N]``; otherwise as :func:`grouped_gemm`)."""
    return _launch(dy, w_packed, w_scale, fmt, m_splits, out, True, "grouped_gemm_dgrad")
