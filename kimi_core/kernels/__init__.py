"""W4A16 grouped GEMM over 4-bit experts (MXFP4 / INT4) and GPU fake quantization.

Public ops (validated here, once):

* :func:`w4a16_grouped_gemm` ``(x [T, K] bf16, w_packed, w_scale, fmt, m_splits) -> y [T, N] bf16``
* :func:`w4a16_grouped_gemm_dgrad` ``(dy [T, N] bf16, w_packed, w_scale, fmt, m_splits) -> dx [T, K] bf16``
* :class:`W4A16GroupedGemm` / :func:`w4a16_grouped_linear`: autograd tying the two (the 4-bit base
  is frozen: gradients flow to ``x`` only).
* :func:`choose_path`: the dispatcher both ops (and so the autograd forward, its recompute and the dgrad) go through.
* :func:`fake_quant_gpu`, :func:`fake_int4_gpu`, :func:`fake_mxfp4_gpu`: straight-through fake
  quantization, bit-exact with :mod:`kimi_core.quant`.
* :func:`kimi_core.kernels.bf16_grouped.bf16_grouped_linear`: the same grouped linear over bf16 experts
  (``torch._grouped_mm``), the BF16 baseline.

Three paths compute the grouped GEMM, chosen per call by :func:`choose_path` from the mean tokens per expert and
the weight shape:

* ``"fused"``: CUDA tensors run the Triton kernels of :mod:`kimi_core.kernels.triton_w4a16` (decode in
  registers, no bf16 weight in HBM); anything else runs the pure-torch twin :mod:`kimi_core.kernels.reference`.
* ``"chunked"``: :mod:`kimi_core.kernels.w4a16_chunked`, a few experts at a time decoded into a bf16 workspace
  of at most 1 GiB (``KIMI_W4A16_WORKSPACE_BYTES``) and multiplied by ``torch._grouped_mm``, the next decode
  overlapped on a side stream. Also runs on CPU tensors (torch decode), for tests.
* ``"gluon"``: the warp-specialised Gluon kernels (Hopper only; :data:`GLUON_OPTIONS` picks
  :mod:`kimi_core.kernels.gluon_w4a16_rs`, the weights decoded into the wgmma's registers, forward and dgrad, or
  :mod:`kimi_core.kernels.gluon_w4a16`), where :data:`W4A16_GLUON` lists a range: from 128 tokens per expert on the
  four measured K3 / K2 expert shapes (issue #21).

``KIMI_W4A16_PATH=fused|chunked|gluon|auto`` (or the ``path=`` argument, which wins) forces a path. Triton is
imported only on first GPU use, so this package imports on machines without a GPU or without Triton.

Example::

    from kimi_core.kernels import w4a16_grouped_linear
    y = w4a16_grouped_linear(x, layer.weight_packed, layer.weight_scale, "mxfp4-pack-quantized", [5, 0, 11])
"""

from __future__ import annotations

import functools
import os

import torch

from kimi_core.kernels import reference, w4a16_chunked

MXFP4_FORMAT = "mxfp4-pack-quantized"
INT4_FORMAT = "pack-quantized"
_WHERE = "kimi_core/kernels"
PATH_ENV = "KIMI_W4A16_PATH"
PATHS = ("fused", "chunked", "gluon", "auto")

#: The dispatcher's crossover: from this mean number of tokens per expert (``T / E``) on, the chunked
#: dequantize-then-``_grouped_mm`` path is chosen over the fused kernel, per op; an ``(N, K)`` key overrides
#: ``"default"`` for that weight shape. Source: benchmarks/RESULTS.md, "W4A16 grouped GEMM: BF16 vs fused vs
#: chunked" (H200, 2026-12-02, both paths timed on every shape and format): at 512 tokens/expert chunked beats
#: fused on all four shapes, MXFP4 and INT4, forward and dgrad (K3 fc1 MXFP4 forward 5.78 vs 6.86 ms, dgrad
#: 5.76 vs 7.28 ms); at 128 fused wins everywhere (1.81 vs 3.71 ms). 256 is not measured yet.
W4A16_CROSSOVER: dict[str, dict] = {"fwd": {"default": 512}, "dgrad": {"default": 512}}

#: Where auto picks the Gluon kernels instead, per op: a half-open range ``(from, to)`` of mean tokens per expert
#: (``to`` None: no upper end) or None (never); an ``(N, K)`` key overrides ``"default"``. Source: benchmarks/
#: RESULTS.md, "W4A16 grouped GEMMs: the register-fragment dgrad and decode ahead" (2026-12-05: the register
#: kernels, forward and dgrad, every shape and format at 8 / 128 / 512 / 2048 tokens per expert, H100) against the
#: fused and chunked rows of "the Gluon kernels measured" (H200, 2026-12-04), as speed relative to BF16 on each GPU,
#: in the format each model ships (K3: MXFP4, K2: INT4). From 128 tokens per expert the register kernels beat fused
#: on every shape, forward and dgrad (K3 fc1 MXFP4 128: forward 1.33x BF16 vs fused 0.76x, dgrad 1.05x vs 0.68x;
#: K2 fc2 INT4 128: dgrad 0.81x vs 0.46x), and chunked at 512 (K3 fc1 MXFP4 dgrad 0.80x vs 0.57x). At 2048 the forward
#: stays Gluon (K3 fc1 MXFP4 0.87x vs chunked 0.83x, K2 fc1 INT4 0.85-0.96x vs 0.77x), and so does the dgrad since
#: its per-call transposed scales go through a tiled transpose (benchmarks/RESULTS.md, 2026-12-06, H100: dgrad at 2048
#: K3 fc1 0.85x / 0.92x MXFP4 / INT4 vs chunked 0.80x / 0.79x, K3 fc2 0.84x / 0.90x vs 0.77x / 0.77x, K2 fc2 0.83x /
#: 0.89x vs 0.85x / 0.85x, without chunked's 0.66-0.98 GiB workspace). At 8 the fused kernel wins everywhere (forward
#: 1.4-2.2x BF16 vs the register kernel's 1.2-1.9x). Shapes not measured (e.g. the demos' small models) keep the
#: fused / chunked table.
_MEASURED_SHAPES = ((6144, 3584), (3584, 3072), (4096, 7168), (7168, 2048))  # (N, K): K3 fc1, K3 fc2, K2 fc1, K2 fc2
W4A16_GLUON: dict[str, dict] = {op: {"default": None, **{shape: (128, None) for shape in _MEASURED_SHAPES}}
                                for op in ("fwd", "dgrad")}

#: The kernel and options the ``"gluon"`` path runs, per op: ``kernel`` ``"smem"`` (:mod:`.gluon_w4a16`, decoded
#: tiles in shared memory) or ``"registers"`` (:mod:`.gluon_w4a16_rs`, the weights decoded into the wgmma's
#: register fragment); the rest are that kernel's keyword arguments (tile sizes, persistent, decode ahead). The
#: measured best (same source): the register kernels with their own tile pick (256 columns up to 128 mean rows,
#: else 128 columns x 256 rows), persistent, decoding ahead on 128-column tiles, forward and dgrad, MXFP4 decoded
#: with one multiply where every scale byte allows it (``fold_scales``: 3-9 % faster on the H100, 2026-12-06; the
#: exact two-multiply decode otherwise).
GLUON_OPTIONS: dict[str, dict] = {op: {"kernel": "registers", "persistent": True, "decode_ahead": "auto",
                                       "fold_scales": True} for op in ("fwd", "dgrad")}

#: The keyword arguments the ``"fused"`` path passes to :mod:`.triton_w4a16`'s launchers, per op: ``fold_scales``
#: (MXFP4 decoded with one multiply where every scale byte allows it; the same bits; sm_90a K loop at 8 tokens per
#: expert: forward 295 -> 259, dgrad 615 -> 520 instructions): H100 2026-12-06, bitwise equal and 0.4-8.6 % faster on
#: every MXFP4 row at 8 and 32 tokens per expert (benchmarks/RESULTS.md).
FUSED_OPTIONS: dict[str, dict] = {op: {"fold_scales": True} for op in ("fwd", "dgrad")}


def _check(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_WHERE}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{_WHERE}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{_WHERE}: {name} must be {dtype}, got {t.dtype}")


def _validate(a: torch.Tensor, a_name: str, w_packed, w_scale, fmt: str, m_splits, a_cols: str) -> tuple[int, int, int]:
    """Check shapes and dtypes; returns ``(E, N, K)``."""
    if fmt == MXFP4_FORMAT:
        _check("w_packed", w_packed, 3, torch.uint8)
        _check("w_scale", w_scale, 3, torch.uint8)
        per = 2
    elif fmt == INT4_FORMAT:
        _check("w_packed", w_packed, 3, torch.int32)
        _check("w_scale", w_scale, 3, torch.bfloat16)
        per = 8
    else:
        raise ValueError(f"{_WHERE}: fmt must be {MXFP4_FORMAT!r} or {INT4_FORMAT!r}, got {fmt!r}")
    E, N = w_packed.shape[0], w_packed.shape[1]
    K = w_packed.shape[2] * per
    if tuple(w_scale.shape) != (E, N, K // 32) or K % 32:
        raise ValueError(f"{_WHERE}: w_scale shape {tuple(w_scale.shape)} does not match w_packed "
                         f"{tuple(w_packed.shape)} ({fmt}); expected {(E, N, K // 32)}")
    _check(a_name, a, 2, torch.bfloat16)
    want = K if a_cols == "K" else N
    if a.shape[1] != want:
        raise ValueError(f"{_WHERE}: {a_name} has {a.shape[1]} columns, expected {a_cols} = {want}")
    n_splits = m_splits.numel() if isinstance(m_splits, torch.Tensor) else len(m_splits)
    if n_splits != E:
        raise ValueError(f"{_WHERE}: m_splits has {n_splits} entries, expected one per expert ({E})")
    if not isinstance(m_splits, torch.Tensor) or m_splits.device.type == "cpu":
        total = int(sum(int(v) for v in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)))
        if total != a.shape[0]:
            raise ValueError(f"{_WHERE}: m_splits sum to {total}, but {a_name} has {a.shape[0]} rows")
    if a.device != w_packed.device or a.device != w_scale.device:
        raise ValueError(f"{_WHERE}: {a_name}, w_packed and w_scale must share a device, got "
                         f"{a.device}, {w_packed.device}, {w_scale.device}")
    return E, N, K


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _forced_path(path: str | None) -> str:
    chosen = path if path is not None else (os.environ.get(PATH_ENV, "").strip() or "auto")
    if chosen not in PATHS:
        src = "path" if path is not None else PATH_ENV
        raise ValueError(f"{_WHERE}: {src} must be one of {', '.join(PATHS)}, got {chosen!r}")
    return chosen


def choose_path(op: str, T: int, E: int, N: int, K: int, device, path: str | None = None) -> str:
    """``"fused"`` or ``"chunked"`` (or a forced ``"gluon"``) for one grouped GEMM of ``T`` rows over ``E`` experts
    of ``[N, K]``.

    :param op: ``"fwd"`` or ``"dgrad"`` (rows of :data:`W4A16_CROSSOVER` and :data:`W4A16_GLUON`).
    :param device: where the operands live; ``"fused"`` on a CPU means the pure-torch reference.
    :param path: ``"fused"`` / ``"chunked"`` / ``"gluon"`` forces a path, ``"auto"`` or ``None`` (then
        ``$KIMI_W4A16_PATH``, default ``auto``) asks the tables, on a CUDA device of compute capability 9.0+ only:
        ``"gluon"`` where ``T / E`` lies in :data:`W4A16_GLUON`'s range for ``(N, K)`` (and the shape suits the
        Gluon kernels), else ``"chunked"`` when one expert fits the workspace bound and ``T / E`` reaches
        :data:`W4A16_CROSSOVER`, else ``"fused"``.
    """
    forced = _forced_path(path)
    if forced != "auto":
        return forced
    device = torch.device(device)
    if device.type != "cuda" or E == 0:
        return "fused"
    if _capability(device.index if device.index is not None else torch.cuda.current_device())[0] < 9:
        return "fused"
    gluon = W4A16_GLUON[op].get((N, K), W4A16_GLUON[op]["default"])
    if gluon is not None and _gluon_fits(N, K) and gluon[0] <= T / E and (gluon[1] is None or T / E < gluon[1]):
        return "gluon"
    if not w4a16_chunked.fits(N, K, op):
        return "fused"
    table = W4A16_CROSSOVER[op]
    return "chunked" if T / E >= table.get((N, K), table["default"]) else "fused"


def _gluon_fits(N: int, K: int) -> bool:
    """Shapes both Gluon kernels take in either format (:func:`.gluon_w4a16.shape_fits` with MXFP4's 1-byte scales,
    the strictest) and a Triton with Gluon to run them."""
    from kimi_core.kernels.gluon_w4a16 import HAVE_GLUON, shape_fits

    return HAVE_GLUON and shape_fits(N, K)


def run_gluon(op: str, a: torch.Tensor, w_packed, w_scale, fmt: str, m_splits, options: dict | None = None
              ) -> torch.Tensor:
    """One op (``"fwd"``: ``a`` = ``x``; ``"dgrad"``: ``a`` = ``dy``) on a Gluon kernel: ``options`` =
    ``{"kernel": "smem" | "registers", **that kernel's keyword arguments}`` (default: :data:`GLUON_OPTIONS`, what the
    ``"gluon"`` path runs). ``"smem"`` is :mod:`.gluon_w4a16`, ``"registers"`` :mod:`.gluon_w4a16_rs` (the
    weights decoded into the wgmma's register fragment)."""
    source = f"GLUON_OPTIONS[{op!r}]['kernel']" if options is None else "the Gluon kernel"
    options = dict(GLUON_OPTIONS[op] if options is None else options)
    kernel = options.pop("kernel", "smem")
    if kernel == "registers":
        from kimi_core.kernels import gluon_w4a16_rs

        fn = gluon_w4a16_rs.grouped_gemm if op == "fwd" else gluon_w4a16_rs.grouped_gemm_dgrad
        return fn(a, w_packed, w_scale, fmt, m_splits, **options)
    if kernel != "smem":
        raise ValueError(f"{_WHERE}: {source} must be 'smem' or 'registers', got {kernel!r}")
    from kimi_core.kernels import gluon_w4a16

    fn = gluon_w4a16.grouped_gemm if op == "fwd" else gluon_w4a16.grouped_gemm_dgrad
    return fn(a, w_packed, w_scale, fmt, m_splits, **options)


def w4a16_grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                       m_splits, *, path: str | None = None) -> torch.Tensor:
    """Grouped ``y = x . dequant(W_e)^T`` over experts, weights kept 4-bit.

    :param x: ``[T, K]`` bf16, rows sorted by expert.
    :param w_packed: MXFP4 uint8 ``[E, N, K/2]`` or INT4 int32 ``[E, N, K/8]`` (on-disk layouts of
        :mod:`kimi_core.quant.mxfp4` / :mod:`kimi_core.quant.int4`).
    :param w_scale: MXFP4 E8M0 uint8 ``[E, N, K/32]`` or INT4 bf16 ``[E, N, K/32]``.
    :param fmt: ``"mxfp4-pack-quantized"`` or ``"pack-quantized"``.
    :param m_splits: rows per expert, ``list[int]`` or integer tensor ``[E]``; zeros allowed.
    :param path: ``"fused"``, ``"chunked"``, ``"gluon"`` or ``"auto"`` (default: ``$KIMI_W4A16_PATH``, else auto), see
        :func:`choose_path`.
    :returns: ``[T, N]`` bf16 (fp32 accumulation). Reference twin: ``reference.w4a16_grouped_gemm``.
    """
    E, N, K = _validate(x, "x", w_packed, w_scale, fmt, m_splits, "K")
    chosen = choose_path("fwd", x.shape[0], E, N, K, x.device, path)
    if chosen == "chunked":
        return w4a16_chunked.grouped_gemm(x, w_packed, w_scale, fmt, m_splits)
    if chosen == "gluon":
        return run_gluon("fwd", x, w_packed, w_scale, fmt, m_splits)
    if x.is_cuda:
        from kimi_core.kernels import triton_w4a16

        return triton_w4a16.grouped_gemm(x, w_packed, w_scale, fmt, m_splits, **FUSED_OPTIONS["fwd"])
    return reference.w4a16_grouped_gemm(x, w_packed, w_scale, fmt, m_splits)


def w4a16_grouped_gemm_dgrad(dy: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                             m_splits, *, path: str | None = None) -> torch.Tensor:
    """Grouped ``dx = dy . dequant(W_e)``: the activation gradient of :func:`w4a16_grouped_gemm`.

    :param dy: ``[T, N]`` bf16, rows sorted by expert; other arguments as in the forward.
    :returns: ``[T, K]`` bf16 (fp32 accumulation). Reference twin: ``reference.w4a16_grouped_gemm_dgrad``.
    """
    E, N, K = _validate(dy, "dy", w_packed, w_scale, fmt, m_splits, "N")
    chosen = choose_path("dgrad", dy.shape[0], E, N, K, dy.device, path)
    if chosen == "chunked":
        return w4a16_chunked.grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits)
    if chosen == "gluon":
        return run_gluon("dgrad", dy, w_packed, w_scale, fmt, m_splits)
    if dy.is_cuda:
        from kimi_core.kernels import triton_w4a16

        return triton_w4a16.grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits, **FUSED_OPTIONS["dgrad"])
    return reference.w4a16_grouped_gemm_dgrad(dy, w_packed, w_scale, fmt, m_splits)


class W4A16GroupedGemm(torch.autograd.Function):
    """Autograd of the grouped W4A16 GEMM: forward :func:`w4a16_grouped_gemm`, backward its dgrad.

    The 4-bit weights are frozen, so ``backward`` returns a gradient for ``x`` only. Forward (and so an
    activation recompute) and dgrad each ask :func:`choose_path`, with the same ``path`` override.
    """

    @staticmethod
    def forward(ctx, x, w_packed, w_scale, fmt, m_splits, *path):
        ctx.save_for_backward(w_packed, w_scale)
        ctx.n_inputs = 5 + len(path)  # ``path`` is optional: apply(x, w_packed, w_scale, fmt, m_splits[, path])
        ctx.fmt, ctx.m_splits, ctx.path = fmt, m_splits, path[0] if path else None
        return w4a16_grouped_gemm(x, w_packed, w_scale, fmt, m_splits, path=ctx.path)

    @staticmethod
    def backward(ctx, dy):
        w_packed, w_scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = w4a16_grouped_gemm_dgrad(dy.to(torch.bfloat16).contiguous(), w_packed, w_scale, ctx.fmt, ctx.m_splits,
                                          path=ctx.path)
        return (dx,) + (None,) * (ctx.n_inputs - 1)


def w4a16_grouped_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, fmt: str,
                         m_splits, path: str | None = None) -> torch.Tensor:
    """Differentiable :func:`w4a16_grouped_gemm` (``[T, K] -> [T, N]``); gradients reach ``x`` only.

    ``path`` forces ``"fused"`` / ``"chunked"`` / ``"gluon"`` for the forward and the dgrad (default:
    :func:`choose_path`).
    """
    return W4A16GroupedGemm.apply(x, w_packed, w_scale, fmt, m_splits, path)


def fake_int4_gpu(w: torch.Tensor, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Straight-through fake INT4 of ``w`` ``[..., K]`` (groups of 32); Triton on CUDA, else :func:`kimi_core.quant.fake_int4`."""
    if w.is_cuda:
        from kimi_core.kernels import triton_fake_quant

        return triton_fake_quant.fake_int4_gpu(w, scale_divisor, q_min)
    from kimi_core.quant import fake_int4

    return fake_int4(w, scale_divisor, q_min)


def fake_mxfp4_gpu(w: torch.Tensor) -> torch.Tensor:
    """Straight-through fake MXFP4 of ``w`` ``[..., K]``; Triton on CUDA, else :func:`kimi_core.quant.fake_mxfp4`."""
    if w.is_cuda:
        from kimi_core.kernels import triton_fake_quant

        return triton_fake_quant.fake_mxfp4_gpu(w)
    from kimi_core.quant import fake_mxfp4

    return fake_mxfp4(w)


def fake_quant_gpu(w: torch.Tensor, fmt: str, scale_divisor: float = 7.0, q_min: int = -7) -> torch.Tensor:
    """Fake quantization of ``w`` to format ``fmt`` (``scale_divisor``/``q_min`` apply to INT4 only)."""
    if fmt == MXFP4_FORMAT:
        return fake_mxfp4_gpu(w)
    if fmt == INT4_FORMAT:
        return fake_int4_gpu(w, scale_divisor, q_min)
    raise ValueError(f"{_WHERE}: fmt must be {MXFP4_FORMAT!r} or {INT4_FORMAT!r}, got {fmt!r}")


__all__ = [
    "GLUON_OPTIONS",
    "INT4_FORMAT",
    "MXFP4_FORMAT",
    "PATHS",
    "PATH_ENV",
    "W4A16GroupedGemm",
    "W4A16_CROSSOVER",
    "W4A16_GLUON",
    "choose_path",
    "fake_int4_gpu",
    "fake_mxfp4_gpu",
    "fake_quant_gpu",
    "run_gluon",
    "w4a16_grouped_gemm",
    "w4a16_grouped_gemm_dgrad",
    "w4a16_grouped_linear",
]
