"""Where the reference model gets its weights, and the one LoRA-aware linear every module calls.

A *source* is anything with ``get(name)``, ``has(name)``, ``keys()`` and
``get_weight(module, dtype)``: :class:`kimi_core.checkpoint.CheckpointReader` (memory-mapped
safetensors, real releases and ``kimi-rl make-tiny`` output) or :class:`StateDictSource` (an
in-memory dict with the same HF names, for tests). ``get_weight`` returns the plain
``<module>.weight`` or the exact dequantization of ``<module>.weight_packed/.weight_scale``.

:class:`Weights` caches dense weights in the model dtype once, and never caches routed experts:
they stay packed in the source and are dequantized per layer, per forward, only for the experts
the router picked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.quant import get_format
from kimi_core.reference.ops import linear as _linear

if TYPE_CHECKING:
    from kimi_core.lora.resolve import AdapterLookup

__all__ = ["StateDictSource", "Weights"]


class StateDictSource:
    """A dict of HF-named tensors with the :class:`~kimi_core.checkpoint.CheckpointReader` read API.

    :param tensors: ``{hf_name: tensor}``, packed experts included (``weight_packed``/``weight_scale``).
    :param quant_format: compressed-tensors format of packed weights (``config.quant.format``).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], quant_format: str | None = None, where: str = "state dict"):
        self.tensors = tensors
        self.quant_format = quant_format
        self.where = where

    def keys(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.where}: tensor {name!r} not found") from None

    def get_weight(self, module: str, dtype: torch.dtype = torch.float32, shape=None) -> torch.Tensor:
        if f"{module}.weight_packed" in self.tensors:
            if self.quant_format is None:
                raise KeyError(f"{self.where}: {module} is packed but no quantization format was given")
            w = get_format(self.quant_format).dequantize(
                self.tensors[f"{module}.weight_packed"], self.tensors[f"{module}.weight_scale"], dtype
            )
        else:
            w = self.get(f"{module}.weight").to(dtype)
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise KeyError(f"{self.where}: {module} has shape {tuple(w.shape)}, expected {tuple(shape)}")
        return w


class Weights:
    """Typed, cached access to one model's weights plus the adapter-aware :meth:`linear`.

    :param source: a checkpoint reader or :class:`StateDictSource`.
    :param dtype: model dtype; dense weights are cast to it once and cached.
    :param device: where weights live.
    """

    def __init__(self, source, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.source = source
        self.dtype = dtype
        self.device = torch.device(device)
        self._cache: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def weight(self, module: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``<module>.weight`` (dense) in ``dtype`` (default: model dtype), cached."""
        dtype = dtype or self.dtype
        key = f"{module}.weight@{dtype}"
        w = self._cache.get(key)
        if w is None:
            w = self.source.get_weight(module, dtype).to(self.device)
            self._cache[key] = w
        return w

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Raw tensor ``name`` (e.g. ``...A_log``) in ``dtype`` (default: model dtype), cached."""
        dtype = dtype or self.dtype
        key = f"{name}@{dtype}"
        t = self._cache.get(key)
        if t is None:
            t = self.source.get(name).to(self.device, dtype)
            self._cache[key] = t
        return t

    def expert_weight(self, module: str) -> torch.Tensor:
        """A routed expert's weight, dequantized now and not cached (experts stay packed)."""
        return self.source.get_weight(module, self.dtype).to(self.device)

    def linear(
        self, x: torch.Tensor, module: str, adapter: AdapterLookup | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x @ W(module).T`` plus ``adapter.dense(module)``'s delta; ``module`` is the full HF name."""
        lora = adapter.dense(module) if adapter is not None else None
        return _linear(x, self.weight(module, dtype), lora)
