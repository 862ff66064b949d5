"""Where and when a benchmark ran, for the JSON every benchmark writes: commit, machine, date and the command that
reproduces it (the four fields each table of ``docs/performance.md`` carries), and the best-of-N timer of the CPU
benchmarks. The scripts print their tables and write JSON; none of them edits a doc.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def best(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` after one warm-up call (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def git_commit(default: str = "unknown") -> str:
    """Short HEAD commit, with ``+ uncommitted changes`` when the tree differs from it. ``$KIMI_COMMIT`` wins: a
    GPU machine gets a copy of the working tree whose ``.git`` may not match the files."""
    if os.environ.get("KIMI_COMMIT"):
        return os.environ["KIMI_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
        if out.returncode != 0 or not out.stdout.strip():
            return default
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except OSError:
        return default


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (falls back to :mod:`platform`)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine() -> str:
    """``"<GPU name> x<count>"`` when CUDA is up, else ``"<CPU model>, <n> CPUs"``."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"{cpu_name()}, {os.cpu_count()} CPUs"


def today() -> str:
    return datetime.date.today().isoformat()


def command(script: str | None = None) -> str:
    """``python benchmarks/<script> <args>`` as this process was started."""
    script = script or os.path.basename(sys.argv[0])
    return f"python benchmarks/{script} {' '.join(sys.argv[1:])}".strip()


def stamp(script: str | None = None) -> dict:
    """``{"date", "commit", "machine", "command"}`` of this run."""
    return {"date": today(), "commit": git_commit(), "machine": machine(), "command": command(script)}


def write_json(path: str | None, payload: dict) -> None:
    """``payload`` to ``path`` (when given) atomically: a run cut short leaves the last complete file."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table of ``rows`` under ``header`` (cells printed with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
