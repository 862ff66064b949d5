"""Lazy reader of (sharded) safetensors checkpoints in HF layout.

Reads ``model.safetensors.index.json`` (or a single ``model.safetensors`` / any ``*.safetensors``),
memory-maps shards on demand and never loads the whole checkpoint. A compressed-tensors
quantized linear (``<m>.weight_packed`` + ``<m>.weight_scale`` [+ ``<m>.weight_shape``]) is one
logical weight: :meth:`CheckpointReader.get_weight` returns it exactly dequantized, and
:meth:`CheckpointReader.get_packed` returns the raw on-disk tensors.

Byte accounting (``bytes_read``) lets tests prove that a rank reads only its shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from kimi_core.config import KimiConfig, load_config
from kimi_core.errors import KimiError
from kimi_core.quant import FormatError, get_format
from kimi_core.quant.formats import weight_format

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(KimiError, KeyError):
    """A tensor is missing, or a checkpoint file is absent or malformed."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def _open_shard(path: str, device: str = "cpu"):
    """``safe_open`` of one shard; a truncated or foreign file is a :class:`CheckpointError` naming it."""
    try:
        return safe_open(path, framework="pt", device=device)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class CheckpointReader:
    """Lazy, memory-mapped access to the tensors of one HF checkpoint directory.

    :param path: directory with ``config.json`` and safetensors shards.
    :param device: where returned tensors live (``"cpu"`` default).
    """

    def __init__(self, path: str | os.PathLike, device: str = "cpu"):
        self.path = os.fspath(path)
        self.device = device
        self.bytes_read = 0
        self._handles: dict[str, object] = {}
        self._weight_map = self._read_weight_map()
        self._config: KimiConfig | None = None

    # ------------------------------------------------------------------ index
    def _read_weight_map(self) -> dict[str, str]:
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        idx = os.path.join(self.path, INDEX_NAME)
        if os.path.exists(idx):
            try:
                with open(idx) as f:
                    wm = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{idx}: malformed index ({e})") from None
            for shard in set(wm.values()):
                if not os.path.exists(os.path.join(self.path, shard)):
                    raise CheckpointError(f"{idx}: lists shard {shard!r}, which is missing from {self.path}")
            return dict(wm)
        shards = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors files and no {INDEX_NAME}")
        wm = {}
        for s in shards:
            with _open_shard(os.path.join(self.path, s)) as f:
                for k in f.keys():
                    wm[k] = s
        return wm

    def _handle(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            h = _open_shard(os.path.join(self.path, shard), self.device)
            self._handles[shard] = h
        return h

    # ------------------------------------------------------------------ basic access
    @property
    def config(self) -> KimiConfig:
        if self._config is None:
            self._config = load_config(self.path)
        return self._config

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str) -> str:
        return self._weight_map[name]

    def shards(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    def get(self, name: str) -> torch.Tensor:
        """The raw tensor ``name`` as stored (memory-mapped; counted in ``bytes_read``)."""
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        t = self._handle(shard).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def items(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Iterate ``(name, tensor)`` lazily, shard by shard."""
        names = list(self._weight_map) if names is None else list(names)
        by_shard: dict[str, list[str]] = {}
        for n in names:
            by_shard.setdefault(self._weight_map.get(n, ""), []).append(n)
        for shard in sorted(by_shard):
            for n in by_shard[shard]:
                yield n, self.get(n)

    # ------------------------------------------------------------------ logical weights
    def is_packed(self, module: str) -> bool:
        return f"{module}.weight_packed" in self._weight_map

    def quant_format(self) -> str:
        q = self.config.quant
        if q is None:
            raise CheckpointError(
                f"{self.path}: packed expert weights found but config.json has no quantization_config"
            )
        return q.format

    def get_packed(self, module: str) -> dict[str, torch.Tensor]:
        """On-disk tensors of a quantized linear: ``weight_packed``, ``weight_scale`` (and ``weight_shape``
        if stored)."""
        out = {}
        for suffix in ("weight_packed", "weight_scale"):
            name = f"{module}.{suffix}"
            if name not in self._weight_map:
                raise CheckpointError(f"{self.path}: quantized weight {module!r} is missing {name!r}")
            out[suffix] = self.get(name)
        if f"{module}.weight_shape" in self._weight_map:
            out["weight_shape"] = self.get(f"{module}.weight_shape")
        fmt = self.quant_format()
        want_dtype = weight_format(fmt).packed_dtype
        if out["weight_packed"].dtype != want_dtype:
            raise FormatError(
                f"{self.path}: {module}.weight_packed is {out['weight_packed'].dtype}, but format "
                f"{fmt!r} stores {want_dtype}"
            )
        return out

    def get_weight(
        self, module: str, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Logical weight of ``module`` (``<module>.weight`` or its exact dequantization).

        :param shape: expected shape; a mismatch raises an error naming the tensor.
        """
        if self.is_packed(module):
            t = self.get_packed(module)
            w = get_format(self.quant_format()).dequantize(t["weight_packed"], t["weight_scale"], dtype)
            if "weight_shape" in t and tuple(int(v) for v in t["weight_shape"].tolist()) != tuple(w.shape):
                raise FormatError(
                    f"{self.path}: {module}.weight_shape {t['weight_shape'].tolist()} does not match "
                    f"the packed data {tuple(w.shape)}"
                )
        else:
            w = self.get(f"{module}.weight").to(dtype)
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: {module} has shape {tuple(w.shape)}, config implies {tuple(shape)}")
        return w

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
