"""What a checkpoint folder holds, cheaply: shard names, sizes, a hash of each safetensors header and of a sample.

A safetensors file is ``[8-byte little-endian header length n][n bytes of JSON header][data]``; the header
lists every tensor's name, dtype, shape and byte range, so its hash changes with any renamed, reshaped or
added tensor, and the byte ranges tell whether the file was cut short. A hash of the first and last MiB of
the data tells apart two checkpoints of one layout (another seed, a retrained copy). Reading costs about
two MiB a shard, not the shard (a 595 GB release is fingerprinted in seconds). ``kimi-rl dequantize``
records the fingerprint of its input in the output folder and resumes only into a folder made from the
same input."""

from __future__ import annotations

import hashlib
import json
import os
import struct

from kimi_core.checkpoint.reader import CheckpointError

#: a header larger than this is not a safetensors header (the format caps it at 100 MB)
MAX_HEADER_BYTES = 100 * 2**20
#: bytes hashed at each end of a shard's data (two reads a shard, whatever its size)
SAMPLE_BYTES = 2**20


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw safetensors header of ``path`` and its parsed JSON, checked for truncation.

    :raises CheckpointError: the file is shorter than its header says, or its header is not safetensors'.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
        raw = f.read(n)
    if len(raw) < n:
        raise CheckpointError(f"{path}: truncated ({size} bytes; its header alone takes {8 + n})")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise CheckpointError(f"{path}: truncated ({size} bytes; its header describes {need})")
    return raw, header


def shard_fingerprint(path: str) -> dict:
    """``{"bytes", "header_sha256", "sample_sha256"}`` of one safetensors file (:func:`read_header` checks it).

    ``sample_sha256`` hashes the first and last :data:`SAMPLE_BYTES` of the data: two checkpoints of the same
    layout (same header) but other weights, such as another seed or a retrained copy, differ there.
    """
    raw, _ = read_header(path)
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        start = 8 + len(raw)
        f.seek(start)
        h.update(f.read(SAMPLE_BYTES))
        f.seek(max(start, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))
    return {"bytes": size, "header_sha256": hashlib.sha256(raw).hexdigest(), "sample_sha256": h.hexdigest()}


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def checkpoint_fingerprint(folder: str, shards: list[str]) -> dict:
    """``{"config_sha256", "shards": {name: shard_fingerprint}}`` of a checkpoint folder's ``shards``."""
    return {
        "config_sha256": file_sha256(os.path.join(folder, "config.json")),
        "shards": {s: shard_fingerprint(os.path.join(folder, s)) for s in shards},
    }


def differences(recorded: dict, now: dict) -> list[str]:
    """Readable differences between two fingerprints (``[]`` when they are the same input)."""
    out = []
    if recorded.get("config_sha256") != now.get("config_sha256"):
        out.append("config.json differs")
    a, b = recorded.get("shards", {}), now.get("shards", {})
    for s in sorted(set(a) - set(b)):
        out.append(f"shard {s} is not in the input")
    for s in sorted(set(b) - set(a)):
        out.append(f"shard {s} is new in the input")
    for s in sorted(set(a) & set(b)):
        if a[s] != b[s]:
            what = (
                "size"
                if a[s].get("bytes") != b[s].get("bytes")
                else "header"
                if a[s].get("header_sha256") != b[s].get("header_sha256")
                else "data"
            )
            out.append(f"shard {s}: {what} differs")
    return out
