"""Operands derived from a frozen weight tensor (the Gluon kernels' padded and transposed group scales and their TMA
descriptors), built once per tensor and version and kept on the tensor, so a call does not rebuild them.

The key is the tensor's version counter (bumped by every in-place write: a load, an optimizer step), its data pointer,
shape and strides: a changed weight gets a new derived copy. While a CUDA graph is being captured a missing copy is
built for that call only (its memory and its kernel belong to the graph); inference tensors, which have no version
counter, are never cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["derived"]

Derived = TypeVar("Derived")


def derived(w: torch.Tensor, name: str, build: Callable[[torch.Tensor], Derived]) -> Derived:
    """``build(w)`` for the current contents of ``w``, cached on ``w`` under ``name`` (see the module docstring)."""
    if torch.is_inference(w):
        return build(w)
    key = (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    cache = w.__dict__.setdefault("_kimi_derived", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = build(w)
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        cache[name] = (key, value)
    return value
