"""Load a native HF Kimi checkpoint straight into the Megatron model, and export back to HF names.

No BF16 copy and no ``torch_dist`` conversion: :func:`load_hf_checkpoint` walks this rank's
state dict, maps every entry through :mod:`kimi_megatron_plugin.mapping` and reads only this
rank's piece of each HF tensor (rows or columns of a TP-split tensor through safetensors'
``get_slice``, only the local experts under EP, only the local layers under PP). Routed experts
are copied as their packed bytes in ``w4a16`` mode. :class:`ShardReader` counts what it reads.

:func:`export_hf_state_dict` is the inverse (gathering TP and EP pieces; each PP stage exports its
own layers) and restores HF dtypes and quirks, so import -> export is bit-exact.

Errors name the checkpoint, the HF tensor, the megatron parameter and the expected/actual value.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from safetensors import safe_open

from kimi_core.checkpoint import CheckpointError, CheckpointReader
from kimi_core.quant import FormatError, get_format
from kimi_core.quant.formats import INT4, WEIGHT_FORMATS, weight_format
from kimi_megatron_plugin import mapping

__all__ = ["ShardReader", "load_hf_checkpoint", "export_hf_state_dict", "unwrap_model", "all_gather_cat", "gather_tp"]


class ShardReader:
    """Slice-reading front of :class:`kimi_core.checkpoint.CheckpointReader`.

    ``get(name, dim=None, part=None)`` returns the whole tensor, or chunk ``part = (rank, size)``
    along ``dim``, reading only that chunk. ``bytes_read`` (also added to the wrapped reader's
    counter) and ``read_log[name]`` (bytes per tensor) account for every byte returned.
    """

    def __init__(self, reader: CheckpointReader | str | os.PathLike):
        self.reader = reader if isinstance(reader, CheckpointReader) else CheckpointReader(reader)
        self.path = self.reader.path
        self.bytes_read = 0
        self.read_log: dict[str, int] = defaultdict(int)
        self.dtypes: dict[str, torch.dtype] = {}
        self._handles: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def _slice(self, name: str):
        if not self.reader.has(name):
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        shard = self.reader.shard_of(name)
        h = self._handles.get(shard)
        if h is None:
            h = safe_open(os.path.join(self.path, shard), framework="pt", device="cpu")
            self._handles[shard] = h
        return h.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dim: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None or part is None or part[1] == 1:
            t = sl[:]
        else:
            rank, size = part
            full = sl.get_shape()[dim]
            if full % size:
                raise CheckpointError(
                    f"{self.path}: {name} has {full} entries along dim {dim}, not divisible by the parallel size {size}"
                )
            step = full // size
            idx = [slice(None)] * len(sl.get_shape())
            idx[dim] = slice(rank * step, (rank + 1) * step)
            t = sl[tuple(idx)]
        n = t.numel() * t.element_size()
        self.bytes_read += n
        self.reader.bytes_read += n
        self.read_log[name] += n
        self.dtypes[name] = t.dtype
        return t


def unwrap_model(model):
    """Strip DDP / Float16Module style ``.module`` wrappers (one model chunk)."""
    while hasattr(model, "module") and not hasattr(model, "decoder") and not hasattr(model, "embedding"):
        model = model.module
    return model


def _parallel():
    from megatron.core import parallel_state as ps

    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
    }


def _layer_index(model, local: int | None) -> int | None:
    if local is None:
        return None
    return model.decoder.layers[local].layer_number - 1


def _entries(model):
    """``(megatron name, tensor, rule, match, global layer)`` for every weight of this rank."""
    for name, t in model.state_dict(keep_vars=True).items():
        if mapping.IGNORED.fullmatch(name):
            continue
        found = mapping.match(name)
        if found is None:
            raise KeyError(f"kimi_megatron_plugin.mapping: no HF name for megatron parameter {name!r}")
        rule, m, local = found
        yield name, t, rule, m, _layer_index(model, local)


def _check_quant(reader: ShardReader, kimi, hf: str, t: torch.Tensor, meg: str) -> None:
    """A packed expert tensor's dtype must be what ``quantization_config.format`` stores."""
    fmt = kimi.quant.format if kimi.quant is not None else None
    if hf.endswith("weight_packed") or hf.endswith("weight_scale"):
        if fmt is None:
            raise FormatError(
                f"{reader.path}: {hf} is a packed 4-bit tensor but config.json declares no "
                f"quantization_config (expected one of {sorted(WEIGHT_FORMATS)})"
            )
        want = weight_format(fmt)
        exp = want.packed_dtype if hf.endswith("weight_packed") else want.scale_dtype
        if t.dtype != exp:
            raise FormatError(
                f"{reader.path}: {hf} is {t.dtype}, but quantization_config.format={fmt!r} stores "
                f"{exp} (megatron {meg}); the checkpoint is not in the declared format"
            )


def _read_expert_logical(reader: ShardReader, kimi, module: str, dtype) -> torch.Tensor:
    """Dequantized ``[out, in]`` of one expert module (qat / dense masters)."""
    if reader.has(f"{module}.weight_packed"):
        if not reader.has(f"{module}.weight_scale"):
            raise CheckpointError(f"{reader.path}: quantized weight {module!r} is missing {module}.weight_scale")
        packed, scale = reader.get(f"{module}.weight_packed"), reader.get(f"{module}.weight_scale")
        _check_quant(reader, kimi, f"{module}.weight_packed", packed, module)
        _check_quant(reader, kimi, f"{module}.weight_scale", scale, module)
        return get_format(kimi.quant.format).dequantize(packed, scale, dtype)
    return reader.get(f"{module}.weight").to(dtype)


@torch.no_grad()
def load_hf_checkpoint(model, path_or_reader, strict: bool = True) -> ShardReader:
    """Fill ``model`` (this rank's ``GPTModel`` chunk) from the HF checkpoint; returns the reader.

    Reads only this rank's pieces. Records the HF dtype and shape of every tensor read in
    ``model.kimi_hf_meta`` for :func:`export_hf_state_dict`. With ``strict`` every weight must
    be found; a shape or dtype mismatch always raises, naming the tensor.
    """
    reader = path_or_reader if isinstance(path_or_reader, ShardReader) else ShardReader(path_or_reader)
    model = unwrap_model(model)
    kimi = model.kimi_config
    par = _parallel()
    tp_rank, tp = par["tp"]
    ep_rank, _ep = par["ep"]
    meta = getattr(model, "kimi_hf_meta", {})
    for name, t, rule, m, layer in _entries(model):
        if rule.split == "expert":
            n_local = t.shape[0]
            pieces = []
            for i in range(n_local):
                e = ep_rank * n_local + i
                (hf,) = mapping.hf_names(rule, m, kimi, layer, e)
                if name.endswith("_weight"):
                    piece = _read_expert_logical(reader, kimi, hf, t.dtype)
                    meta[hf] = (None, tuple(piece.shape))
                else:
                    if not reader.has(hf):
                        raise CheckpointError(
                            f"{reader.path}: tensor {hf!r} not found in the checkpoint "
                            f"(needed by megatron {name}; is the checkpoint quantized as config.json says?)"
                        )
                    piece = reader.get(hf)
                    _check_quant(reader, kimi, hf, piece, name)
                    meta[hf] = (piece.dtype, tuple(piece.shape))
                pieces.append(piece)
            value = torch.stack(pieces)
        else:
            hfs = mapping.hf_names(rule, m, kimi, layer)
            for hf in hfs:
                if not reader.has(hf):
                    if strict:
                        raise CheckpointError(
                            f"{reader.path}: tensor {hf!r} not found in the checkpoint (needed by megatron {name})"
                        )
                    continue
                meta[hf] = (None, reader.shape(hf))
            if rule.hook:
                full = reader.get(hfs[0])
                value = mapping.HOOKS[rule.hook][0](full, kimi, hfs[0])
                if rule.split == "col" and tp > 1:
                    value = value.chunk(tp, dim=0)[tp_rank]
            elif rule.split == "rep":
                value = reader.get(hfs[0])
            elif rule.split in ("col", "row"):
                value = reader.get(hfs[0], dim=0 if rule.split == "col" else 1, part=(tp_rank, tp))
            elif rule.split == "glu":
                value = torch.cat([reader.get(h, dim=0, part=(tp_rank, tp)) for h in hfs], dim=0)
            else:  # pragma: no cover - table is data
                raise ValueError(f"unknown split {rule.split!r}")
            hf_desc = hfs[0] if len(hfs) == 1 else " + ".join(hfs)
        if rule.split == "expert":
            hf_desc = mapping.hf_names(rule, m, kimi, layer, ep_rank * t.shape[0])[0] + " (and the other local experts)"
        if tuple(value.shape) != tuple(t.shape):
            raise CheckpointError(
                f"{reader.path}: {hf_desc} gives shape {tuple(value.shape)} for megatron {name}, but config.json "
                f"implies {tuple(t.shape)} (tensor parallel rank {tp_rank}/{tp}); config and weights disagree"
            )
        if not t.is_floating_point() and value.dtype != t.dtype:
            raise FormatError(f"{reader.path}: {hf_desc} is {value.dtype}, megatron {name} holds {t.dtype}")
        t.copy_(value.to(t.dtype))
    for hf, (dt, shape) in list(meta.items()):
        if dt is None and hf in reader.dtypes:
            meta[hf] = (reader.dtypes[hf], shape)
    model.kimi_hf_meta = meta
    return reader


# ---------------------------------------------------------------------------------------------- export
def all_gather_cat(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``t`` of ``group`` concatenated along ``dim`` in rank order (``t`` itself without a group
    of more than one process); every rank of ``group`` must call it."""
    size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_tp(v: torch.Tensor, split: str, tp_group) -> list[torch.Tensor]:
    """The full tensor(s) of this rank's TP piece ``v`` of a parameter split as a mapping rule's ``split``:
    ``[full]`` for ``col`` (dim 0), ``row`` (dim 1) and unsplit parameters; ``[gate, up]`` for ``glu``
    (the local ``[gate; up]`` halves, each gathered on dim 0)."""
    if split == "col":
        return [all_gather_cat(v, 0, tp_group)]
    if split == "row":
        return [all_gather_cat(v, 1, tp_group)]
    if split == "glu":
        return [all_gather_cat(half, 0, tp_group) for half in v.chunk(2, dim=0)]
    return [v]


def _hf_dtype(meta: dict, hf: str, default: torch.dtype) -> torch.dtype:
    d = meta.get(hf, (None, None))[0]
    return d if d is not None else default


@torch.no_grad()
def export_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """HF-named tensors of this rank's pipeline stage (TP and EP pieces gathered).

    Dtypes and ``A_log`` padding follow ``model.kimi_hf_meta`` (recorded by
    :func:`load_hf_checkpoint`), else the release conventions (fp32 for ``A_log``, ``dt_bias``,
    conv weights and the router bias; bf16 otherwise). Experts export as ``weight_packed`` /
    ``weight_scale`` (+ ``weight_shape`` for INT4); ``qat`` masters are re-quantized on the served grid.
    Every rank of a TP/EP group must call it (collectives).
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    kimi = model.kimi_config
    meta = getattr(model, "kimi_hf_meta", {})
    tp_group = ps.get_tensor_model_parallel_group() if torch.distributed.is_initialized() else None
    ep_group = ps.get_expert_model_parallel_group() if torch.distributed.is_initialized() else None
    ep_rank = ps.get_expert_model_parallel_rank() if torch.distributed.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}

    def put(hf: str, v: torch.Tensor):
        default = torch.float32 if mapping.FP32_TENSORS.fullmatch(hf) else torch.bfloat16
        out[hf] = v.detach().to("cpu", _hf_dtype(meta, hf, default if v.is_floating_point() else v.dtype)).contiguous()

    experts_done = set()
    for name, t, rule, m, layer in _entries(model):
        if rule.split == "expert":
            mod = name.rsplit(".", 1)[0]
            if mod in experts_done:
                continue
            experts_done.add(mod)
            experts = model.get_submodule(mod)
            for proj in ("gate", "up", "down"):
                for i in range(experts.E):
                    tensors = experts.packed(proj, i)
                    e_local = {k: v for k, v in tensors.items()}
                    # gather every rank's local experts (equal shapes) over EP
                    for k in ("weight_packed", "weight_scale"):
                        allv = all_gather_cat(e_local[k].unsqueeze(0), 0, ep_group)
                        for r in range(allv.shape[0]):
                            e = r * experts.E + i
                            base = f"{kimi.lm_prefix}model.layers.{layer}.{kimi.moe_prefix}.experts.{e}"
                            hf = f"{base}.{dict(zip(('gate', 'up', 'down'), kimi.expert_names))[proj]}"
                            out[f"{hf}.{k}"] = allv[r].cpu().contiguous()
                            if k == "weight_packed" and experts.fmt is INT4:
                                o, inp = experts.shapes[proj]
                                ws = f"{hf}.weight_shape"
                                out[ws] = torch.tensor([o, inp], dtype=meta.get(ws, (torch.int64,))[0] or torch.int64)
            continue
        hfs = mapping.hf_names(rule, m, kimi, layer)
        full = gather_tp(t.detach(), rule.split, tp_group)
        if rule.split == "glu":
            put(hfs[0], full[0])
            put(hfs[1], full[1])
            continue
        v = full[0]
        if rule.hook:
            v = mapping.HOOKS[rule.hook][1](v, kimi, hfs[0], meta.get(hfs[0], (None, None))[1])
        put(hfs[0], v)
    del ep_rank
    return out
