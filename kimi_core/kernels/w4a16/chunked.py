"""Chunked dequantize-then-GEMM W4A16 grouped GEMM: 4-bit experts decoded a few at a time into a bounded bf16
workspace, each chunk multiplied by BF16 ``torch._grouped_mm`` (its CUTLASS grouped GEMM on sm90, fp32 accumulation).

Forward ``y[T, N] = x[T, K] . dequant(W_e)^T`` and dgrad ``dx[T, K] = dy[T, N] . dequant(W_e)`` per expert, the
same contract as the fused kernels of :mod:`kimi_core.kernels.w4a16.fused` (pure-torch twin:
:mod:`kimi_core.kernels.w4a16.naive`). The dispatcher (:mod:`kimi_core.kernels.w4a16.dispatch`) picks this path at
large tokens per expert, where the decode of each weight is amortised over many rows.

**Workspace bound.** The bf16 workspace never exceeds ``workspace_bytes`` (default :data:`DEFAULT_WORKSPACE_BYTES`
= 1 GiB, or the environment variable ``KIMI_W4A16_WORKSPACE_BYTES``). One expert takes
``n_out * K * 2`` bytes (``n_out = N``; for the dgrad ``N`` rounded up to a multiple of 8, see below). If the whole
layer fits, it is decoded at once into one buffer and multiplied by one ``_grouped_mm``. Otherwise two ping-pong
buffers of ``floor(workspace_bytes / 2 / expert)`` experts each; when not even two experts fit, one buffer of one
expert (decode and GEMM then serialise); when one expert does not fit, :func:`plan_chunks` raises. Besides the
workspace a call holds the per-chunk ``_grouped_mm`` output (``rows of the chunk x N`` bf16, copied into ``y``
and freed; none when the layer is one chunk) and, for the dgrad of an ``N % 8 != 0`` layer, ``dy`` padded to
``n_out`` columns. The workspace comes from the caching allocator for the duration of the call, so it is
returned to the pool between calls rather than pinned for the life of the process.

**Streams.** With more than one chunk, chunk ``c + 1`` is decoded on a side stream (one per device, high
priority) while chunk ``c``'s GEMM runs on the current stream. Ordering is by CUDA events: the side stream first
waits for the current stream (inputs ready); the GEMM of chunk ``c`` waits for the event recorded after its
decode; the decode into a buffer waits for the event recorded after the last GEMM that read that buffer, so a
decode never overwrites weights a GEMM still reads; the current stream has waited for every decode when the
call returns, so callers see an ordinary single-stream op. CPU tensors run the same schedule inline.

**Host offsets.** The chunk boundaries over experts depend only on ``E, N, K`` and the bound, but slicing the
rows of a chunk needs the host to know the split: with ``m_splits`` a CUDA tensor and more than one chunk, the
call reads the ``[E]`` splits back once (one device-to-host sync). Host splits' per-chunk offsets are built and
copied once per split pattern (:func:`chunk_ends`, cached on the :class:`~kimi_core.kernels.host_ints.SplitPattern`). A layer that fits in one chunk needs no sync:
the device offsets go to ``_grouped_mm`` as they are. Chunks whose experts have no rows are skipped.

**Alignment.** ``_grouped_mm`` wants 16-byte aligned data pointers and a row stride that is a multiple of 16
bytes (8 bf16) for both operands. ``K`` is a multiple of 32 by format, so ``x``, ``dx`` and the workspace
always qualify; ``dy`` needs ``N % 8 == 0``, otherwise ``dy`` is copied into ``[T, n_out]`` zero-padded columns
and the workspace carries ``n_out - N`` zero rows per expert, which add nothing to the product. Operands whose
data pointer is not 16-byte aligned are copied.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch

from kimi_core.kernels.device import interpreting
from kimi_core.kernels.host_ints import int32_on, split_pattern
from kimi_core.quant.formats import weight_format

DEFAULT_WORKSPACE_BYTES = 1 << 30
WORKSPACE_ENV = "KIMI_W4A16_WORKSPACE_BYTES"
_WHERE = "kimi_core/kernels/w4a16/chunked"


def workspace_bound(workspace_bytes: int | None = None) -> int:
    """The bound in bytes: ``workspace_bytes``, else ``$KIMI_W4A16_WORKSPACE_BYTES``, else 1 GiB."""
    if workspace_bytes is None:
        env = os.environ.get(WORKSPACE_ENV, "").strip()
        if not env:
            return DEFAULT_WORKSPACE_BYTES
        try:
            workspace_bytes = int(env)
        except ValueError:
            raise ValueError(f"{_WHERE}: {WORKSPACE_ENV} must be an integer number of bytes, got {env!r}") from None
    if workspace_bytes <= 0:
        raise ValueError(f"{_WHERE}: the workspace bound must be positive, got {workspace_bytes} bytes")
    return int(workspace_bytes)


def workspace_rows(N: int, op: str) -> int:
    """Rows per expert in the workspace: ``N`` (forward), ``N`` rounded up to 8 (dgrad: 16-byte rows of ``dy``)."""
    return N if op == "fwd" else -(-N // 8) * 8


@dataclass(frozen=True)
class ChunkPlan:
    """How a layer is split: expert ``bounds`` ``[0, ..., E]``, ``buffers`` (1 or 2) of ``per_buffer`` experts."""

    bounds: tuple[int, ...]
    buffers: int
    per_buffer: int
    n_out: int
    K: int

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the bf16 workspace this plan allocates."""
        return self.buffers * self.per_buffer * self.n_out * self.K * 2


def plan_chunks(E: int, N: int, K: int, op: str = "fwd", workspace_bytes: int | None = None) -> ChunkPlan:
    """Split ``E`` experts of ``[N, K]`` into contiguous chunks whose bf16 workspace stays within the bound.

    Chunks are as even as possible (sizes differ by at most one). Raises ``ValueError`` when one expert alone
    exceeds the bound (the dispatcher does not choose this path then).
    """
    bound = workspace_bound(workspace_bytes)
    n_out = workspace_rows(N, op)
    expert = n_out * K * 2
    if E == 0 or expert == 0:
        return ChunkPlan((0, E), 1, E, n_out, K)
    if E * expert <= bound:
        return ChunkPlan((0, E), 1, E, n_out, K)
    if expert > bound:
        raise ValueError(
            f"{_WHERE}: one expert [{n_out}, {K}] bf16 is {expert} bytes, more than the workspace "
            f"bound of {bound} bytes ({WORKSPACE_ENV})"
        )
    buffers = 2 if 2 * expert <= bound else 1
    per = bound // buffers // expert
    chunks = -(-E // per)
    bounds = tuple(c * E // chunks for c in range(chunks + 1))
    per = max(b - a for a, b in zip(bounds, bounds[1:]))
    return ChunkPlan(bounds, buffers, per, n_out, K)


def fits(N: int, K: int, op: str = "fwd", workspace_bytes: int | None = None) -> bool:
    """Whether one expert's bf16 weights fit in the workspace bound (the chunked path is possible)."""
    return workspace_rows(N, op) * K * 2 <= workspace_bound(workspace_bytes)


# ---------------------------------------------------------------------------------------------------------------
# streams: CUDA side stream + events, or inline (CPU tensors). Tests substitute a tracer with the same methods.
# ---------------------------------------------------------------------------------------------------------------


class InlineStreams:
    """Decode and GEMM in program order on one queue: CPU tensors, and CUDA layers that are a single chunk."""

    def fork(self) -> None:
        """Make the side queue wait for everything queued on the main one so far."""

    def side(self):
        """Context in which decode kernels are launched."""
        return contextlib.nullcontext()

    def record(self, where: str):
        """A token that completes when the work queued so far on ``where`` (``"main"``/``"side"``) completes."""
        return None

    def wait(self, where: str, token) -> None:
        """Make later work on ``where`` wait for ``token`` (``None``: nothing to wait for)."""

    def note(self, where: str, op: str, chunk: int, buf: int) -> None:
        """Hook called before each decode / GEMM (the tracer of the tests records them)."""


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        if index not in _SIDE_STREAMS:
            _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
        return _SIDE_STREAMS[index]


class CudaStreams(InlineStreams):
    """The current stream runs the GEMMs, a per-device side stream the decodes; events order the two."""

    def __init__(self, device: torch.device):
        self.streams = {"main": torch.cuda.current_stream(device), "side": _side_stream(device)}

    def fork(self) -> None:
        self.streams["side"].wait_stream(self.streams["main"])

    def side(self):
        return torch.cuda.stream(self.streams["side"])

    def record(self, where: str):
        ev = torch.cuda.Event()
        ev.record(self.streams[where])
        return ev

    def wait(self, where: str, token) -> None:
        if token is not None:
            self.streams[where].wait_event(token)


def pipeline(chunks: list[int], buffers: int, decode, gemm, streams: InlineStreams) -> None:
    """Run ``decode(c, b)`` then ``gemm(c, b)`` for each chunk ``c`` of ``chunks``, buffer ``b`` alternating.

    The decode of the next chunk is queued on the side stream right after this chunk's GEMM, so with two
    buffers it overlaps that GEMM; with one buffer it waits for it. A single chunk runs on the main stream only.
    """
    if not chunks:
        return
    if len(chunks) == 1:
        streams.note("main", "decode", chunks[0], 0)
        decode(chunks[0], 0)
        streams.note("main", "gemm", chunks[0], 0)
        gemm(chunks[0], 0)
        return
    streams.fork()
    released = [None] * buffers  # token of the last GEMM that read each buffer
    ready = {}

    def queue_decode(i: int) -> None:
        b = i % buffers
        with streams.side():
            streams.wait("side", released[b])  # never overwrite weights a GEMM still reads
            streams.note("side", "decode", chunks[i], b)
            decode(chunks[i], b)
            ready[i] = streams.record("side")

    queue_decode(0)
    for i, c in enumerate(chunks):
        b = i % buffers
        streams.wait("main", ready.pop(i))
        streams.note("main", "gemm", c, b)
        gemm(c, b)
        released[b] = streams.record("main")
        if i + 1 < len(chunks):
            queue_decode(i + 1)


# ---------------------------------------------------------------------------------------------------------------
# decode and the two ops
# ---------------------------------------------------------------------------------------------------------------


def _decode_into(w_packed, w_scale, fmt: str, e0: int, e1: int, buf: torch.Tensor) -> None:
    """``buf[: e1 - e0]`` (bf16 ``[n, n_out, K]``) = the exact bf16 experts ``[e0, e1)``, zero padding rows."""
    if w_packed.is_cuda or interpreting():
        from kimi_core.kernels.w4a16.dequant_experts import decode_experts

        decode_experts(w_packed, w_scale, fmt, e0, e1 - e0, buf)
        return
    from kimi_core.quant import dequantize

    N = w_packed.shape[1]
    buf[: e1 - e0, :N] = dequantize(weight_format(fmt).name, w_packed[e0:e1], w_scale[e0:e1], torch.bfloat16)
    if buf.shape[1] > N:
        buf[: e1 - e0, N:] = 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def chunk_ends(pattern, plan: ChunkPlan, device) -> tuple[torch.Tensor, list[int]]:
    """``(ends, chunks)`` of host splits ``pattern`` (:class:`~kimi_core.kernels.host_ints.SplitPattern`) under
    ``plan``: int32 ``[E]`` on ``device``, each expert's end row relative to its chunk's first row (the ``offs`` of
    that chunk's ``_grouped_mm``), and the chunks that have rows."""
    off = pattern.offsets
    rel = [
        off[e + 1] - off[plan.bounds[c]]
        for c in range(plan.num_chunks)
        for e in range(plan.bounds[c], plan.bounds[c + 1])
    ]
    chunks = [c for c in range(plan.num_chunks) if off[plan.bounds[c + 1]] > off[plan.bounds[c]]]
    return int32_on(rel, device), chunks


@torch.no_grad()  # like the Triton kernels: no autograd graph (it would keep the workspace alive)
def _grouped(
    a: torch.Tensor,
    out_rows: int,
    out_cols: int,
    w_packed,
    w_scale,
    fmt: str,
    m_splits,
    op: str,
    out,
    workspace_bytes,
    streams,
) -> torch.Tensor:
    """Shared body of :func:`grouped_gemm` (``op="fwd"``) and :func:`grouped_gemm_dgrad` (``op="dgrad"``)."""
    E, N = w_packed.shape[0], w_packed.shape[1]
    K = w_scale.shape[2] * 32
    dev = a.device
    if out_rows == 0 or out_cols == 0 or N == 0:  # nothing to multiply; an empty contraction gives zeros
        y = out if out is not None else torch.empty((out_rows, out_cols), dtype=torch.bfloat16, device=dev)
        return y.zero_()
    plan = plan_chunks(E, N, K, op, workspace_bytes)
    if op == "dgrad" and plan.n_out != N:
        a = torch.nn.functional.pad(a, (0, plan.n_out - N))
    a = _aligned(a)  # [T, K] (fwd) or [T, n_out] (dgrad)
    single = plan.num_chunks == 1
    pattern = split_pattern(m_splits)
    if single and pattern is None:
        off, ends = None, m_splits.to(device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        chunks = [0]
    else:
        if pattern is None:  # a device tensor over several chunks: read back once (a sync)
            pattern = split_pattern(m_splits.cpu())
        off = pattern.offsets
        ends, chunks = pattern.table(("chunk_ends", plan.bounds, dev), lambda: chunk_ends(pattern, plan, dev), dev)
    if streams is None:
        streams = CudaStreams(dev) if dev.type == "cuda" and len(chunks) > 1 else InlineStreams()
    ws = torch.empty(
        (plan.buffers if len(chunks) > 1 else 1, plan.per_buffer, plan.n_out, K), dtype=torch.bfloat16, device=dev
    )
    result = {}  # "y": the output; a single chunk without ``out`` returns _grouped_mm's own tensor (no copy)
    if not single or out is not None:
        result["y"] = out if out is not None else torch.empty((out_rows, out_cols), dtype=torch.bfloat16, device=dev)

    def decode(c: int, b: int) -> None:
        _decode_into(w_packed, w_scale, fmt, plan.bounds[c], plan.bounds[c + 1], ws[b])

    def gemm(c: int, b: int) -> None:
        e0, e1 = plan.bounds[c], plan.bounds[c + 1]
        w = ws[b, : e1 - e0]
        lo, hi = (0, out_rows) if off is None else (off[e0], off[e1])
        r = torch._grouped_mm(
            a[lo:hi], w.transpose(1, 2) if op == "fwd" else w, offs=ends[e0:e1], out_dtype=torch.bfloat16
        )
        if "y" in result:
            result["y"][lo:hi].copy_(r)
        else:
            result["y"] = r if r.is_contiguous() else r.contiguous()

    pipeline(chunks, plan.buffers, decode, gemm, streams)
    return result["y"]


def grouped_gemm(
    x,
    w_packed,
    w_scale,
    fmt: str,
    m_splits,
    out=None,
    workspace_bytes: int | None = None,
    streams: InlineStreams | None = None,
) -> torch.Tensor:
    """Chunked forward; arguments as :func:`kimi_core.kernels.w4a16.w4a16_grouped_gemm` (already validated).

    :param x: ``[T, K]`` bf16, rows sorted by expert.
    :param out: optional ``[T, N]`` bf16 output.
    :param workspace_bytes: bound of the bf16 workspace (default :func:`workspace_bound`).
    :param streams: scheduling (tests); default CUDA streams for a multi-chunk CUDA call, else inline.
    :returns: ``[T, N]`` bf16.
    """
    return _grouped(
        x, x.shape[0], w_packed.shape[1], w_packed, w_scale, fmt, m_splits, "fwd", out, workspace_bytes, streams
    )


def grouped_gemm_dgrad(
    dy,
    w_packed,
    w_scale,
    fmt: str,
    m_splits,
    out=None,
    workspace_bytes: int | None = None,
    streams: InlineStreams | None = None,
) -> torch.Tensor:
    """Chunked dgrad ``dx = dy . dequant(W_e)``; arguments as :func:`kimi_core.kernels.w4a16.w4a16_grouped_gemm_dgrad`.

    :param dy: ``[T, N]`` bf16, rows sorted by expert.
    :returns: ``[T, K]`` bf16 (``out`` if given).
    """
    return _grouped(
        dy, dy.shape[0], w_scale.shape[2] * 32, w_packed, w_scale, fmt, m_splits, "dgrad", out, workspace_bytes, streams
    )
