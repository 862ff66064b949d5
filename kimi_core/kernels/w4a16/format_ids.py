"""The format ids the W4A16 kernels (fused Triton and Gluon) are compiled for, and how a call picks one.

``FMT_MXFP4`` decodes E2M1 codes with E8M0 group scales in two multiplies (exact for every scale byte),
``FMT_INT4`` offset-binary nibbles with bf16 group scales, and ``FMT_MXFP4_FOLDED`` MXFP4 whose scale bytes are
all at most 128, with the decode's ``2^126`` folded into the scale (one multiply, the same bits).
"""

from __future__ import annotations

import torch

from kimi_core.quant.formats import MXFP4, WeightFormat, weight_format

__all__ = ["FMT_INT4", "FMT_MXFP4", "FMT_MXFP4_FOLDED", "format_id", "kernel_format_id", "mxfp4_scales_fold"]

FMT_MXFP4 = 0
FMT_INT4 = 1
FMT_MXFP4_FOLDED = 2


def format_id(fmt: str | WeightFormat) -> int:
    """:data:`FMT_MXFP4` or :data:`FMT_INT4` for a format object or config string."""
    return FMT_MXFP4 if weight_format(fmt) is MXFP4 else FMT_INT4


def mxfp4_scales_fold(w_scale: torch.Tensor) -> bool:
    """Whether every E8M0 byte of ``w_scale`` (uint8, any shape) is at most 128 (scales up to 2, as in any real
    checkpoint: a weight up to 12), so ``2^(s - 1)`` is a normal bf16 and the decode can run as
    :data:`FMT_MXFP4_FOLDED`. Read once per tensor and version (one device sync), remembered on the tensor; while a
    CUDA graph is being captured (where a sync is illegal) an unread tensor answers False: the exact two-multiply
    decode, the same bits."""
    seen = getattr(w_scale, "_kimi_scales_fold", None)
    if seen is not None and seen[0] == w_scale._version:
        return seen[1]
    if w_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    fold = bool((w_scale <= 128).all())
    w_scale._kimi_scales_fold = (w_scale._version, fold)
    return fold


def kernel_format_id(fmt_id: int, w_scale: torch.Tensor, fold_scales: bool) -> int:
    """The format id a kernel runs: :data:`FMT_MXFP4_FOLDED` where ``fold_scales`` asks for it, ``fmt_id`` is
    :data:`FMT_MXFP4` and every scale byte allows it (:func:`mxfp4_scales_fold`), else ``fmt_id``."""
    return FMT_MXFP4_FOLDED if fold_scales and fmt_id == FMT_MXFP4 and mxfp4_scales_fold(w_scale) else fmt_id
