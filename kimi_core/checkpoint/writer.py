"""Sharded safetensors writer with an index, written atomically and readable by the group.

Tensors are grouped into shards of at most ``max_shard_bytes``; every shard and the index are
written to a temporary name in the destination and moved into place with ``os.replace``, so a
crash never leaves a half-written file under a final name. Files get the mode a plain ``open``
would give (``0666`` less the umask, ``0644`` under the usual ``022``): safetensors' writer and
``tempfile`` create ``0600`` files, which an engine running as another user on shared storage
cannot read. :func:`replace_directory` swaps a whole folder in, so a checkpoint rewritten over
an older one never keeps the older one's shards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable

import torch
from safetensors.torch import save_file

from kimi_core.checkpoint.reader import INDEX_NAME


def current_umask() -> int:
    """The process umask, read without changing it where ``/proc`` tells it (set-and-restore elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_group_readable(path: str) -> None:
    """Give ``path`` the mode ``open``/``mkdir`` would: ``0666`` (files) or ``0777`` (folders) less the umask."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~current_umask())


def _tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp.{os.getpid()}")


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name in the same folder, then ``os.replace``."""
    tmp = _tmp_name(path)
    with open(tmp, "w") as f:
        f.write(text)
    make_group_readable(tmp)
    os.replace(tmp, path)


def atomic_copy(src: str, dst: str) -> None:
    """Copy the file ``src`` to ``dst`` (contents and times) through a temporary name."""
    tmp = _tmp_name(dst)
    shutil.copy2(src, tmp)
    make_group_readable(tmp)
    os.replace(tmp, dst)


def save_shard(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    """Write one safetensors file atomically (temporary name, then ``os.replace``), group-readable."""
    tmp = _tmp_name(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata or {"format": "pt"})
    make_group_readable(tmp)
    os.replace(tmp, path)


#: safetensors (0.8) writes a file through Rust's ``tempfile`` crate: ``.tmp`` and six random letters or digits in
#: the target's folder, renamed when complete; a process killed mid-write leaves it behind
_SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`save_shard` / :func:`atomic_write_text` or of the safetensors
    writer under them (a crash's leftover)."""
    return (name.startswith(".") and ".tmp." in name) or _SAFETENSORS_TEMP.fullmatch(name) is not None


def replace_directory(path: str, fill: Callable[[str], object]) -> None:
    """Build a folder with ``fill(tmp_dir)`` next to ``path``, then swap it in for ``path``.

    Until the swap ``path`` keeps its old contents; after it, only what ``fill`` wrote. The old folder is
    moved aside (one ``rename``) and removed; a crash between the two renames leaves the complete new
    folder under its temporary name and the old one under its own, never a mix of both.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.new.{os.getpid()}")
    old = os.path.join(parent, f".{name}.old.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(path):
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


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


def write_checkpoint(
    out_dir: str, tensors: dict[str, torch.Tensor], config: dict | None = None, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Write ``tensors`` as sharded safetensors plus ``model.safetensors.index.json`` and ``config.json``.

    Tensors that belong together (a quantized linear's ``weight_packed``/``weight_scale``/``weight_shape``)
    stay in one shard because shards are cut only between modules. Files are added to ``out_dir`` one by
    one; :func:`replace_directory` around this call replaces a whole older checkpoint instead.

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
