"""The format ids the W4A16 kernels are compiled for (:mod:`kimi_core.kernels.w4a16.format_ids`): when the folded
one-multiply MXFP4 decode is taken."""

from __future__ import annotations

import torch

from kimi_core.kernels.w4a16.format_ids import (
    FMT_INT4,
    FMT_MXFP4,
    FMT_MXFP4_FOLDED,
    format_id,
    kernel_format_id,
    mxfp4_scales_fold,
)
from kimi_core.quant.formats import INT4, MXFP4


def test_mxfp4_scale_fold_is_taken_only_where_every_scale_allows_it():
    """``fold_scales`` (MXFP4 decoded with one multiply by ``2^(s - 1)``, a normal bf16 only for E8M0 bytes ``s <=
    128``) runs the folded format id only when every scale byte of the tensor is at most 128, read once per tensor
    version; otherwise, and for INT4, the exact two-multiply decode."""
    assert (FMT_MXFP4, FMT_INT4, FMT_MXFP4_FOLDED) == (0, 1, 2)  # the literals the kernels branch on
    scales = torch.full((2, 8, 16), 128, dtype=torch.uint8)
    mxfp4, int4 = format_id(MXFP4), format_id(INT4)
    assert kernel_format_id(mxfp4, scales, True) == FMT_MXFP4_FOLDED
    assert kernel_format_id(mxfp4, scales, False) == FMT_MXFP4
    scales[1, 3, 5] = 129  # in place: a new version, read again
    assert kernel_format_id(mxfp4, scales, True) == FMT_MXFP4
    scales[1, 3, 5] = 0
    assert mxfp4_scales_fold(scales)
    assert kernel_format_id(int4, torch.ones(2, 8, 16, dtype=torch.bfloat16), True) == FMT_INT4


def test_mxfp4_scale_fold_reads_nothing_during_graph_capture(monkeypatch):
    """Reading a scale tensor syncs the device, which a CUDA graph capture forbids: an unread CUDA tensor answers
    False there (the exact two-multiply decode, the same bits) and is read at its first use outside a capture."""

    class OnCuda(torch.Tensor):  # a CPU tensor that reports a CUDA device, so no GPU is needed
        @property
        def is_cuda(self):
            return True

    scales = torch.full((2, 8, 16), 120, dtype=torch.uint8).as_subclass(OnCuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not mxfp4_scales_fold(scales)
    assert not hasattr(scales, "_kimi_scales_fold"), "nothing may be read or remembered during a capture"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert mxfp4_scales_fold(scales)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert mxfp4_scales_fold(scales), "a tensor read before the capture keeps its answer"
