"""An adapter in memory (:class:`Adapter`: PEFT tensor names + ``adapter_config`` dict) and its
PEFT directory form (``adapter_config.json`` + ``adapter_model.safetensors``).

Writes go to a temporary name and are moved into place with ``os.replace``, so a reader never
sees half an adapter. Only safetensors is read: a ``.bin``/``.pt`` adapter is refused rather
than unpickled.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch

from kimi_core.checkpoint.writer import make_group_readable
from kimi_core.errors import KimiError
from kimi_core.lora.config import AdapterConfigError, read_adapter_config, validate_adapter_config, write_adapter_config

__all__ = ["Adapter", "AdapterError", "SAFETENSORS_NAME", "CONFIG_NAME"]

SAFETENSORS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


class AdapterError(KimiError, ValueError):
    """An adapter's tensors are missing, malformed or do not fit the model; names file and tensor."""


@dataclass
class Adapter:
    """A LoRA adapter: ``tensors`` keyed by PEFT names (``base_model.model.<module>.lora_A.weight``)
    and the PEFT ``adapter_config`` dict. ``source`` names where it came from, for errors."""

    tensors: dict[str, torch.Tensor]
    adapter_config: dict
    source: str = "<memory>"
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy(self) -> Adapter:
        return Adapter(dict(self.tensors), copy.deepcopy(self.adapter_config), self.source, dict(self.extra))

    def to(self, dtype: torch.dtype) -> Adapter:
        return Adapter(
            {k: v.to(dtype) for k, v in self.tensors.items()},
            copy.deepcopy(self.adapter_config),
            self.source,
            dict(self.extra),
        )

    def save(self, directory: str | os.PathLike) -> str:
        """Write a PEFT adapter directory; returns its path. Existing files are replaced atomically."""
        from safetensors.torch import save_file

        d = os.fspath(directory)
        os.makedirs(d, exist_ok=True)
        validate_adapter_config(self.adapter_config, f"{d}/{CONFIG_NAME}")
        seen: set[int] = set()
        out = {}
        for k, v in self.tensors.items():
            v = v.detach().cpu()
            # safetensors refuses views and tensors that share storage: give each its own copy.
            ptr = v.untyped_storage().data_ptr()
            whole = (
                v.is_contiguous()
                and v.storage_offset() == 0
                and v.untyped_storage().nbytes() == v.numel() * v.element_size()
            )
            if not whole or ptr in seen:
                v = v.clone()
            seen.add(v.untyped_storage().data_ptr())
            out[k] = v
        path = os.path.join(d, SAFETENSORS_NAME)
        tmp = f"{path}.tmp.{os.getpid()}"
        save_file(out, tmp, metadata={"format": "pt"})
        make_group_readable(tmp)  # safetensors writes 0600; an engine running as another user must read it
        os.replace(tmp, path)
        write_adapter_config(self.adapter_config, d)
        return d

    def save_replacing(self, directory: str | os.PathLike) -> str:
        """:meth:`save` into a new directory beside ``directory``, then swap it in: readers see the old
        adapter or the whole new one, never a mix, and no staging folder is left behind."""
        import shutil
        import tempfile

        d = os.fspath(directory)
        parent = os.path.dirname(os.path.abspath(d)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".stage-", dir=parent)
        make_group_readable(tmp)  # mkdtemp makes 0700
        try:
            self.save(tmp)
            if os.path.exists(d):
                shutil.rmtree(d)
            os.replace(tmp, d)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Adapter:
        """Read a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        from safetensors.torch import load_file

        d = os.fspath(directory)
        if not os.path.isdir(d):
            raise AdapterError(f"{d}: adapter directory not found")
        cfg_path = os.path.join(d, CONFIG_NAME)
        if not os.path.exists(cfg_path):
            raise AdapterError(f"{cfg_path}: file not found (a PEFT adapter directory needs {CONFIG_NAME})")
        path = os.path.join(d, SAFETENSORS_NAME)
        if not os.path.exists(path):
            others = [n for n in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(d, n))]
            hint = (
                f"; found {others[0]}, which is pickled and not read here: convert it to safetensors" if others else ""
            )
            raise AdapterError(f"{path}: file not found{hint}")
        try:
            cfg = read_adapter_config(d)
        except AdapterConfigError as e:
            raise AdapterError(str(e)) from None
        try:
            tensors = load_file(path)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
            raise AdapterError(f"{path}: cannot read safetensors ({e})") from None
        return cls(tensors, cfg, source=path)
