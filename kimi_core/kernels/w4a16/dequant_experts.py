"""Triton decode of a contiguous range of 4-bit experts into a bf16 workspace (bandwidth-bound).

``out[e - e0, n, k] = dequant(W_e)[n, k]`` for experts ``e0 <= e < e0 + n_experts``, written as bf16
``[n_experts, n_out, K]`` (row-major). Rows ``N <= n < n_out`` are zero padding: ``torch._grouped_mm``
needs the contraction stride of ``dy`` to be a multiple of 16 bytes, so the dgrad of an ``N % 8 != 0``
layer contracts over ``n_out`` padded rows (see :mod:`kimi_core.kernels.w4a16.chunked`).

The decode is the fused kernels' own word decoder (:func:`kimi_core.kernels.w4a16.fused.decode.decode_words`:
inline PTX on the GPU, its portable twin in the interpreter),
so the workspace holds bit for bit the values of ``kimi_core.quant``'s ``dequantize``. One program
decodes ``BLOCK_R`` weight rows by ``8 * BLOCK_W`` columns: it reads ``BLOCK_W`` int32 words per row
(8 codes each; MXFP4 bytes are reinterpreted as words) and one scale per 4 words, and stores 16 bytes
(8 bf16) per word. Pure-torch twin: ``kimi_core.quant.dequantize`` on ``w_packed[e0 : e0 + n]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimi_core.kernels.device import interpreting
from kimi_core.kernels.w4a16.format_ids import format_id
from kimi_core.kernels.w4a16.fused.decode import decode_words, scale_bf16
from kimi_core.kernels.w4a16.fused.launch import as_words

_INT4_ZERO_WORD = tl.constexpr(-2004318072)  # int32 0x88888888: eight offset-binary zeros (INT4 code 0)


@triton.jit(do_not_specialize=["e0", "total_rows"])  # both change from chunk to chunk: no recompiles
def w4a16_decode_kernel(
    wq_ptr,
    ws_ptr,
    out_ptr,
    e0,
    total_rows,
    N,
    N_OUT,
    KW,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    FMT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Rows ``r = (e - e0) * N_OUT + n`` of the flattened ``[n_experts * N_OUT, 8 * KW]`` bf16 output."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    wd = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # word index within a weight row
    e = (e0 + r // N_OUT).to(tl.int64)
    n = (r % N_OUT).to(tl.int64)
    live = (r < total_rows) & (n < N)  # padding rows decode the zero code
    m = live[:, None] & (wd < KW)[None, :]
    q_ptrs = wq_ptr + (e * stride_we + n * stride_wn)[:, None] + wd[None, :]
    s_ptrs = ws_ptr + (e * stride_se + n * stride_sn)[:, None] + (wd // 4)[None, :]  # one scale group = 4 words
    if FMT == 0:
        q = tl.load(q_ptrs, mask=m, other=0)  # int32 [BR, BW]
        s = tl.load(s_ptrs, mask=m, other=127)
    else:
        q = tl.load(q_ptrs, mask=m, other=_INT4_ZERO_WORD)
        s = tl.load(s_ptrs, mask=m, other=0.0)
    o0, o1, o2, o3, o4, o5, o6, o7 = decode_words(q, scale_bf16(s, FMT), FMT, USE_ASM)
    # join appends a trailing axis, so the bit-reversed order leaves element j at flat index j
    v = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    v = v.reshape(BLOCK_R, BLOCK_W * 8)  # [BR, 8 BW]
    cols = tl.program_id(1) * (BLOCK_W * 8) + tl.arange(0, BLOCK_W * 8)
    out = out_ptr + r.to(tl.int64)[:, None] * (KW * 8) + cols[None, :]
    tl.store(out, v, mask=(r < total_rows)[:, None] & (cols < KW * 8)[None, :])


def decode_experts(
    w_packed, w_scale, fmt, e0: int, n_experts: int, out, block_r: int | None = None, block_w: int | None = None
) -> None:
    """Decode experts ``[e0, e0 + n_experts)`` into ``out`` (bf16 ``[>= n_experts, n_out, K]``, contiguous).

    :param w_packed: MXFP4 uint8 ``[E, N, K/2]`` or INT4 int32 ``[E, N, K/8]`` (validated by the caller).
    :param w_scale: MXFP4 uint8 / INT4 bf16 ``[E, N, K/32]``.
    :param out: the workspace; rows ``n >= N`` of each expert are written as zeros.
    Runs on the current stream; in the interpreter (``TRITON_INTERPRET=1``) it runs on CPU tensors.
    """
    E, N = w_packed.shape[0], w_packed.shape[1]
    K = w_scale.shape[2] * 32
    n_out = out.shape[1]
    if not (
        0 <= e0
        and e0 + n_experts <= E
        and out.shape[0] >= n_experts
        and out.shape[2] == K
        and n_out >= N
        and out.is_contiguous()
    ):
        raise ValueError(
            f"kimi_core/kernels/w4a16/dequant_experts: workspace {tuple(out.shape)} cannot hold experts "
            f"[{e0}, {e0 + n_experts}) of [E={E}, N={N}, K={K}]"
        )
    if n_experts == 0 or K == 0:
        return
    wq = as_words(w_packed)  # [E, N, K / 8]
    ws = w_scale.contiguous()
    interp = interpreting()
    br = block_r or (8 if interp else 16)
    bw = block_w or (16 if interp else 64)
    rows = n_experts * n_out
    grid = (-(-rows // br), -(-(K // 8) // bw))
    w4a16_decode_kernel[grid](
        wq,
        ws,
        out,
        e0,
        rows,
        N,
        n_out,
        K // 8,
        wq.stride(0),
        wq.stride(1),
        ws.stride(0),
        ws.stride(1),
        FMT=format_id(fmt),
        BLOCK_R=br,
        BLOCK_W=bw,
        USE_ASM=not interp,
        num_warps=4,
    )
