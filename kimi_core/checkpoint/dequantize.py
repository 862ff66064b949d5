"""Write BF16 masters of an INT4 / MXFP4 checkpoint (``kimi-rl dequantize``).

Shard by shard, with bounded memory: each input shard is read lazily (memory-mapped), its
packed experts are dequantized exactly to bf16 (``<m>.weight``), other tensors are copied, and
the result is written as one or more output parts of at most ``part_bytes`` each (so the
in-memory buffer never exceeds that), each part atomically and group-readable. The index and
``config.json`` (``quantization_config`` removed) are written at the end.

Tied to its input: the output may not be the input, lie inside it or contain it; before any
shard is written, ``kimi-dequantize.json`` records the input's fingerprint (shard names, sizes,
a hash of each safetensors header and of ``config.json``, :mod:`.fingerprint`) and the settings.
A per-shard marker written last marks a shard finished, which makes the tool resumable: a
re-run into the same folder skips finished shards (reported as not re-verified) and redoes the
others, but only when the recorded input and settings equal the current ones; otherwise it is
refused (:class:`~kimi_core.checkpoint.folders.FolderRefused`) naming what differs. A folder
without the record that is not empty is refused too. Every input shard is checked for
truncation before the first one is dequantized.

Verification re-quantizes every dequantized tensor with the requested convention and compares
bytes (``kimi_core.quant.verify``). Any mismatch means the checkpoint is not its own fixed point
under that convention (an RTN checkpoint, amax/7.5, is not): the shard's parts are removed, the
tensors are named, and :class:`VerificationError` is raised (the CLI exits with code 2).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from tqdm import tqdm

from kimi_core.checkpoint.fingerprint import checkpoint_fingerprint, differences, read_header
from kimi_core.checkpoint.folders import FolderRefused, check_output_folder
from kimi_core.checkpoint.reader import INDEX_NAME, CheckpointReader
from kimi_core.checkpoint.writer import atomic_copy, atomic_write_text, is_temporary, save_shard
from kimi_core.errors import KimiError
from kimi_core.quant import FormatError, get_format
from kimi_core.quant.formats import INT4, weight_format
from kimi_core.quant.verify import check_int4, check_mxfp4

log = logging.getLogger(__name__)

#: what to do about a checkpoint that is not its own fixed point; the only flag it names is one dequantize takes
RTN_HINT = (
    "an RTN checkpoint (scale = amax/7.5, q in [-8, 7]) is not its own fixed point under any convention: its "
    "dequantized weights do not re-quantize to the served bytes. Pass --no-verify to write plain BF16 "
    "weights; to train QAT masters, start from the original BF16 weights (SkyRL: "
    "fake_int4_qat.bf16_base_path) and fake-quantize them with the RTN grid (scale amax/7.5, q_min -8)."
)

#: the record of input and settings a dequantize output folder carries (see the module docstring)
RECORD_NAME = "kimi-dequantize.json"


class VerificationError(KimiError, RuntimeError):
    """Re-quantizing dequantized tensors did not give back the checkpoint's bytes."""

    def __init__(self, bad: dict[str, tuple[int, int]]):
        self.bad = bad
        names = ", ".join(f"{k} (scales {s}, codes {c})" for k, (s, c) in list(bad.items())[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        super().__init__(f"{len(bad)} tensors are not fixed points: {names}{more}. Hint: {RTN_HINT}")


@dataclass
class DequantizeReport:
    written_shards: list[str] = field(default_factory=list)
    skipped_shards: list[str] = field(default_factory=list)  # finished earlier, not re-verified
    dequantized: int = 0
    copied: int = 0
    bad: dict[str, tuple[int, int]] = field(default_factory=dict)


def _manifest(out_dir: str, shard: str) -> str:
    return os.path.join(out_dir, f".{shard}.dequantized.json")


def _part_name(shard: str, j: int) -> str:
    stem = shard[: -len(".safetensors")]
    return f"{stem}-bf16-{j:03d}.safetensors"


def _remove_parts(out_dir: str, shard: str) -> None:
    """Remove what an interrupted run left of ``shard``: its parts and temporary files."""
    prefix = shard[: -len(".safetensors")] + "-bf16-"
    for name in os.listdir(out_dir):
        if name.startswith(prefix) or name.startswith("." + prefix):
            os.remove(os.path.join(out_dir, name))


_ROW_CHUNK_BYTES = 1 << 20  # bf16 output bytes dequantized (and verified) per step


def _dequantize_rows(fmt, packed, scale, verify, scale_divisor, q_min):
    """Dequantize (and verify) a 2-D/3-D packed tensor a few rows at a time to bound transient memory."""
    fmod = get_format(fmt)
    lead, n_in = packed.shape[:-1], scale.shape[-1] * 32
    flat_p, flat_s = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1])
    out = torch.empty(flat_p.shape[0], n_in, dtype=torch.bfloat16)
    rows = max(1, _ROW_CHUNK_BYTES // (2 * n_in))
    total = None
    for r in range(0, flat_p.shape[0], rows):
        p, s = flat_p[r : r + rows], flat_s[r : r + rows]
        w = out[r : r + rows] = fmod.dequantize(p, s, torch.bfloat16)
        if verify:
            rep = (
                check_int4(p, s, scale_divisor, q_min, dequantized=w)
                if weight_format(fmt) is INT4
                else check_mxfp4(p, s, dequantized=w)
            )
            if total is None:
                total = rep
            else:
                total.bad_scales += rep.bad_scales
                total.bad_codes += rep.bad_codes
                total.total_groups += rep.total_groups
    return out.reshape(*lead, n_in), total


def _bound_allocator() -> None:
    """Pin glibc's mmap threshold so freed multi-MB buffers go back to the OS.

    glibc raises its threshold dynamically after freeing a large block, after which every
    expert-sized temporary lives in the heap and is never returned: RSS then grows with the
    number of tensors instead of staying at one buffer. No-op where mallopt is unavailable.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _dequantize_shard(
    in_dir: str,
    out_dir: str,
    shard: str,
    fmt: str | None,
    scale_divisor: float,
    q_min: int,
    verify: bool,
    part_bytes: int,
) -> tuple[dict[str, str], int, int, dict]:
    """Process one input shard; returns (name -> part file, n_dequantized, n_copied, bad)."""
    path = os.path.join(in_dir, shard)
    weight_map: dict[str, str] = {}
    bad: dict[str, tuple[int, int]] = {}
    parts: list[str] = []
    buf: dict[str, torch.Tensor] = {}
    buf_bytes = 0
    n_deq = n_copy = 0

    def flush():
        nonlocal buf, buf_bytes
        if not buf:
            return
        name = _part_name(shard, len(parts))
        save_shard(buf, os.path.join(out_dir, name))
        parts.append(name)
        for k in buf:
            weight_map[k] = name
        buf, buf_bytes = {}, 0

    def add(name, t):
        nonlocal buf_bytes
        nb = t.numel() * t.element_size()
        if buf and buf_bytes + nb > part_bytes:
            flush()
        buf[name] = t
        buf_bytes += nb

    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
        keyset = set(keys)
        for k in keys:
            if k.endswith((".weight_scale", ".weight_shape")) and k.rsplit(".", 1)[0] + ".weight_packed" in keyset:
                continue  # consumed with its weight_packed
            if not k.endswith(".weight_packed"):
                add(k, f.get_tensor(k))
                n_copy += 1
                continue
            mod = k[: -len(".weight_packed")]
            if fmt is None:
                raise FormatError(f"{path}: {k} is packed but config.json has no quantization_config")
            if f"{mod}.weight_scale" not in keyset:
                raise FormatError(f"{path}: {k} has no {mod}.weight_scale in the same shard")
            packed, scale = f.get_tensor(k), f.get_tensor(f"{mod}.weight_scale")
            shp = None
            if weight_format(fmt) is INT4:
                if f"{mod}.weight_shape" not in keyset:
                    raise FormatError(f"{path}: {k} has no {mod}.weight_shape in the same shard")
                shp = tuple(int(v) for v in f.get_tensor(f"{mod}.weight_shape").tolist())
            # names the file and the tensor (packed or scale) whose shape or dtype is off
            weight_format(fmt).check(packed, scale, where=f"{path}: {mod}", in_features=shp[-1] if shp else None)
            w, rep = _dequantize_rows(fmt, packed, scale, verify, scale_divisor, q_min)
            if shp is not None and shp != tuple(w.shape):
                raise FormatError(f"{path}: {mod}.weight_shape {shp} does not match packed data {tuple(w.shape)}")
            if rep is not None and not rep.ok:
                bad[mod] = (rep.bad_scales, rep.bad_codes)
            add(f"{mod}.weight", w)
            n_deq += 1
            del packed, scale
    flush()
    if bad:  # not valid masters: leave nothing behind for this shard
        for p in parts:
            os.remove(os.path.join(out_dir, p))
        return {}, n_deq, n_copy, bad
    atomic_write_text(_manifest(out_dir, shard), json.dumps(weight_map))
    return weight_map, n_deq, n_copy, bad


#: safetensors dtype names of the tensors a packed expert holds
_ST_DTYPES = {
    "I32": torch.int32,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I8": torch.int8,
}


def check_packed_layout(input_dir: str, shards: list[str], fmt: str | None) -> None:
    """Check every packed expert's dtypes and shapes from the shard headers alone (no tensor is read).

    :raises FormatError: naming the shard and the tensor, before any shard is dequantized.
    """
    for s in shards:
        path = os.path.join(input_dir, s)
        _, header = read_header(path)
        for k, v in header.items():
            if not k.endswith(".weight_packed"):
                continue
            mod = k[: -len(".weight_packed")]
            if fmt is None:
                raise FormatError(f"{path}: {k} is packed but config.json has no quantization_config")
            sc = header.get(f"{mod}.weight_scale")
            if sc is None:
                raise FormatError(f"{path}: {k} has no {mod}.weight_scale in the same shard")

            def meta(t):
                return torch.empty(t["shape"], dtype=_ST_DTYPES.get(t["dtype"], torch.float64), device="meta")

            weight_format(fmt).check(meta(v), meta(sc), where=f"{path}: {mod}")


def check_settings(scale_divisor: float, q_min: int, workers: int) -> None:
    """Refuse settings no checkpoint can use, before any file is opened; errors name the flag."""
    if not scale_divisor > 0:
        raise ValueError(f"--scale-divisor {scale_divisor}: must be > 0 (Kimi: 7.0, RTN: 7.5)")
    if not -8 <= q_min <= -1:
        raise ValueError(f"--q-min {q_min}: INT4 codes reach -8 at most (Kimi: -7, RTN: -8)")
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1")


def _open_output(output_dir: str, record: dict) -> tuple[list[str], bool]:
    """Create ``output_dir`` for ``record`` or check that it was made from the same input and settings.

    :returns: the shards an earlier run into this folder finished, and whether this call created the record.
    :raises FolderRefused: the folder holds another input's or other settings' output, or foreign files.
    """
    path = os.path.join(output_dir, RECORD_NAME)
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        diffs = differences(old.get("input", {}), record["input"])
        for k, v in record["settings"].items():
            if old.get("settings", {}).get(k) != v:
                diffs.append(f"{k} was {old.get('settings', {}).get(k)!r}, now {v!r}")
        if diffs:
            raise FolderRefused(
                f"--output {output_dir} holds a dequantize of another input or other settings "
                f"(recorded in {RECORD_NAME}: {old.get('input_path')}): {'; '.join(diffs[:6])}"
                f"{' ...' if len(diffs) > 6 else ''}; name a new folder or remove this one"
            )
        return [s for s in record["input"]["shards"] if os.path.exists(_manifest(output_dir, s))], False
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        raise FolderRefused(
            f"--output {output_dir}: a non-empty folder without {RECORD_NAME} (not written by "
            "dequantize from this input); name a new or empty folder"
        )
    os.makedirs(output_dir, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2))
    return [], True


def dequantize_checkpoint(
    input_dir: str,
    output_dir: str,
    scale_divisor: float = 7.0,
    q_min: int = -7,
    verify: bool = True,
    workers: int = 1,
    part_bytes: int | None = None,
    progress: bool = True,
) -> DequantizeReport:
    """Dequantize ``input_dir`` into BF16 masters in ``output_dir``; see the module docstring.

    :param part_bytes: cap on one output part (the in-memory buffer); default an eighth of the largest input shard.
    :raises FolderRefused: ``output_dir`` is the input, inside it, contains it, or holds another run's output.
    :raises CheckpointError: an input shard is missing, truncated or not safetensors (before any work).
    :raises VerificationError: if ``verify`` and any tensor is not a fixed point (after all shards are checked).
    """
    check_settings(scale_divisor, q_min, workers)
    input_dir, output_dir = os.fspath(input_dir), os.fspath(output_dir)
    check_output_folder(output_dir, "--output", input_dir, "--input")
    _bound_allocator()
    reader = CheckpointReader(input_dir)
    cfg_path = os.path.join(input_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: not found (--input must be a checkpoint folder)")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    fmt = qc.get("format") if qc else None
    if fmt is not None:
        get_format(fmt)
    shards = reader.shards()
    fingerprint = checkpoint_fingerprint(input_dir, shards)  # also refuses a truncated shard, before any work
    check_packed_layout(input_dir, shards, fmt)
    largest = max(fp["bytes"] for fp in fingerprint["shards"].values())
    part_bytes = part_bytes or max(largest // 8, 1 << 20)
    record = {
        "input_path": os.path.abspath(input_dir),
        "input": fingerprint,
        "settings": {
            "format": fmt,
            "scale_divisor": scale_divisor,
            "q_min": q_min,
            "verify": verify,
            "part_bytes": part_bytes,
        },
    }
    finished, created = _open_output(output_dir, record)
    finished = set(finished)
    report = DequantizeReport()
    todo = []
    weight_map: dict[str, str] = {}
    for s in shards:
        if s in finished:
            with open(_manifest(output_dir, s)) as fh:
                weight_map.update(json.load(fh))
            report.skipped_shards.append(s)
        else:
            _remove_parts(output_dir, s)
            todo.append(s)
    for name in os.listdir(output_dir):  # an interrupted run's temporary files
        if is_temporary(name):
            os.remove(os.path.join(output_dir, name))
    if report.skipped_shards:
        log.warning(
            "%d shard(s) finished earlier were skipped and NOT re-verified: %s",
            len(report.skipped_shards),
            ", ".join(report.skipped_shards),
        )
    args = [(input_dir, output_dir, s, fmt, scale_divisor, q_min, verify, part_bytes) for s in todo]
    bar = tqdm(total=len(todo), desc="dequantize", unit="shard", disable=not progress)
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            results = zip(todo, ex.map(_dequantize_shard, *zip(*args)))
            for s, res in results:
                _collect(report, weight_map, s, res)
                bar.update()
    else:
        for s, a in zip(todo, args):
            _collect(report, weight_map, s, _dequantize_shard(*a))
            bar.update()
    bar.close()
    if report.bad:
        if created:  # not valid masters: leave no folder that a re-run with other settings would be refused
            shutil.rmtree(output_dir, ignore_errors=True)
        raise VerificationError(report.bad)
    index = {
        "metadata": {"total_size": _total_size(output_dir, set(weight_map.values()))},
        "weight_map": dict(sorted(weight_map.items())),
    }
    atomic_write_text(os.path.join(output_dir, INDEX_NAME), json.dumps(index, indent=2))
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    atomic_write_text(os.path.join(output_dir, "config.json"), json.dumps(cfg, indent=2))
    for extra in os.listdir(input_dir):  # tokenizer files, generation config, ...
        if (
            not extra.endswith(".safetensors")
            and extra not in ("config.json", INDEX_NAME)
            and os.path.isfile(os.path.join(input_dir, extra))
        ):
            atomic_copy(os.path.join(input_dir, extra), os.path.join(output_dir, extra))
    return report


def _collect(report: DequantizeReport, weight_map: dict, shard: str, res) -> None:
    wm, n_deq, n_copy, bad = res
    report.dequantized += n_deq
    report.copied += n_copy
    report.bad.update(bad)
    if not bad:
        weight_map.update(wm)
        report.written_shards.append(shard)


def _total_size(out_dir: str, parts: set[str]) -> int:
    return sum(os.path.getsize(os.path.join(out_dir, p)) for p in parts)
