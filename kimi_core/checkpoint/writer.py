"""Sharded safetensors writer with an index, written atomically.

Tensors are grouped into shards of at most ``max_shard_bytes``; every shard and the index are
written to a temporary name in the destination and moved into place with ``os.replace``, so a
crash never leaves a half-written file under a final name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

from kimi_core.checkpoint.reader import INDEX_NAME


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_shard(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    """Write one safetensors file atomically (temporary name, then ``os.replace``)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata or {"format": "pt"})
    os.replace(tmp, path)


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    cur = 0
    for name, nbytes in sizes:
        if shards[-1] and cur + nbytes > max_shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(name)
        cur += nbytes
    return shards


def write_checkpoint(out_dir: str, tensors: dict[str, torch.Tensor], config: dict | None = None,
                     max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``tensors`` as sharded safetensors plus ``model.safetensors.index.json`` and ``config.json``.

    Tensors that belong together (a quantized linear's ``weight_packed``/``weight_scale``/``weight_shape``)
    stay in one shard because shards are cut only between modules.

    :returns: the shard file names.
    """
    os.makedirs(out_dir, exist_ok=True)
    # keep each module's tensors together: group by module name (strip the last component)
    modules: dict[str, list[str]] = {}
    for name in tensors:
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    sizes = [(m, sum(tensors[n].numel() * tensors[n].element_size() for n in ns)) for m, ns in modules.items()]
    plan = plan_shards(sizes, max_shard_bytes)
    names = [shard_name(i, len(plan)) for i in range(len(plan))]
    weight_map = {}
    total = 0
    for fname, mods in zip(names, plan):
        part = {n: tensors[n] for m in mods for n in modules[m]}
        save_shard(part, os.path.join(out_dir, fname))
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(os.path.join(out_dir, INDEX_NAME), json.dumps(index, indent=2))
    if config is not None:
        atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(config, indent=2))
    return names
