"""Save and resume LoRA training: one adapter + optimizer shard per rank, plus the HF export.

Layout of a checkpoint directory::

    lora_rank{R}.safetensors   this rank's factors under KimiLora's own names (TP/EP pieces as held)
    optim_rank{R}.pt           this rank's optimizer state dict (tensors, ints, floats only)
    meta_rank{R}.json          step, parallel layout, spec, names and shapes (checked on resume)
    hf_adapter/                PEFT export (adapter_config.json + adapter_model.safetensors), rank 0

(miles K3 writes ``adapter_megatron_rank{R}.pt``; we keep factors in safetensors and load the
optimizer state with ``torch.load(weights_only=True)``.) Every file is written to a temporary
name and moved into place with ``os.replace``. Resuming with a different parallel layout or
spec raises, naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from kimi_core.errors import KimiError

__all__ = ["save", "load", "LoraCheckpointError"]


class LoraCheckpointError(KimiError, ValueError):
    """A LoRA checkpoint does not fit the running trainer; names the file and the field."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _layout(lora) -> dict:
    return {"tp": lora.par["tp"], "tp_rank": lora.par["tp_rank"], "ep": lora.par["ep"], "ep_rank": lora.par["ep_rank"]}


def _spec_dict(spec) -> dict:
    d = dataclasses.asdict(spec)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _atomic(path: str, write) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def save(directory: str, lora, optimizer=None, step: int = 0, hf_export: bool = True) -> str:
    """Write this rank's shard (every rank calls it; the HF export is collective). Returns ``directory``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    r = _rank()
    sd = {k: v.detach().cpu().contiguous() for k, v in lora.state_dict().items()}
    _atomic(os.path.join(directory, f"lora_rank{r}.safetensors"), lambda p: save_file(sd, p))
    if optimizer is not None:
        _atomic(os.path.join(directory, f"optim_rank{r}.pt"), lambda p: torch.save(optimizer.state_dict(), p))
    meta = {
        "step": int(step),
        "layout": _layout(lora),
        "spec": _spec_dict(lora.spec),
        "tensors": {k: list(v.shape) for k, v in sd.items()},
        "optimizer": optimizer is not None,
    }

    def wjson(p):
        with open(p, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)

    _atomic(os.path.join(directory, f"meta_rank{r}.json"), wjson)
    if hf_export:
        ad = lora.export("per_expert", torch.bfloat16)
        if r == 0:
            ad.save(os.path.join(directory, "hf_adapter"))
    return directory


def load(directory: str, lora, optimizer=None) -> dict:
    """Restore this rank's factors (and optimizer state) from :func:`save`; returns the meta dict."""
    from safetensors.torch import load_file

    r = _rank()
    mpath = os.path.join(directory, f"meta_rank{r}.json")
    if not os.path.exists(mpath):
        raise LoraCheckpointError(f"{mpath}: not found (no LoRA shard for rank {r}; saved with another world size?)")
    with open(mpath) as f:
        meta = json.load(f)
    if meta["layout"] != _layout(lora):
        raise LoraCheckpointError(
            f"{mpath}: layout {meta['layout']} != running layout {_layout(lora)}; resume "
            "with the same TP/EP sizes (or re-shard through hf_adapter/)"
        )
    if meta["spec"] != _spec_dict(lora.spec):
        raise LoraCheckpointError(f"{mpath}: spec {meta['spec']} != running LoraSpec {_spec_dict(lora.spec)}")
    spath = os.path.join(directory, f"lora_rank{r}.safetensors")
    sd = load_file(spath)
    own = lora.state_dict()
    if set(sd) != set(own):
        extra, missing = sorted(set(sd) - set(own)), sorted(set(own) - set(sd))
        raise LoraCheckpointError(
            f"{spath}: tensors differ from the running LoRA (unexpected {extra[:3]}, missing {missing[:3]})"
        )
    for k, v in sd.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise LoraCheckpointError(
                f"{spath}: tensor {k!r} is {tuple(v.shape)}, running LoRA has {tuple(own[k].shape)}"
            )
    lora.load_state_dict(sd)
    if optimizer is not None:
        opath = os.path.join(directory, f"optim_rank{r}.pt")
        if not os.path.exists(opath):
            raise LoraCheckpointError(f"{opath}: not found; the checkpoint was saved without optimizer state")
        optimizer.load_state_dict(torch.load(opath, weights_only=True))
    return meta
