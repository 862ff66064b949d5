"""Shared pieces of the benchmark scripts: best-of-N timing, commit, machine and appending to ``RESULTS.md``.

Every script prints its own table; this module only says where and when it was measured, so the
sections in ``benchmarks/RESULTS.md`` carry the same date / machine / commit / command lines.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")


def best(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` after one warm-up call (seconds)."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def git_commit(dirty_paths: tuple[str, ...] = (), dirty_label: str = "", default: str = "unknown") -> str:
    """Short HEAD commit; ``+ uncommitted <dirty_label> changes`` when any of ``dirty_paths`` is modified.
    ``$KIMI_COMMIT`` overrides both: the GPU machine gets a copy of the working tree whose ``.git`` can be older
    than the files (on 2026-12-04 it printed the previous session's HEAD, "+ uncommitted changes", for a committed tree)."""
    if os.environ.get("KIMI_COMMIT"):
        return os.environ["KIMI_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
        commit = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else default
        if dirty_paths:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", *dirty_paths], capture_output=True,
                                   text=True, cwd=HERE).stdout.strip()
            commit += f" + uncommitted {dirty_label} changes" if dirty else ""
    except OSError:
        commit = default
    return commit


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (falls back to :mod:`platform`)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def today() -> str:
    return datetime.date.today().isoformat()


def command(script: str) -> str:
    """``python benchmarks/<script> <args>`` as this process was started."""
    return f"python benchmarks/{script} {' '.join(sys.argv[1:])}".strip()


def cpu_section(title: str, commit: str, script: str, body: str, machine_extra: str = "") -> str:
    """A RESULTS.md section for a CPU benchmark: title, date, machine, commit, command, then ``body``."""
    import torch

    return (f"\n## {title}\n\n- date: {today()}\n- machine: {cpu_name()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads){machine_extra}\n- commit: {commit}\n"
            f"- command: `{command(script)}`\n\n{body}\n")


def append(section: str) -> str:
    """Append ``section`` to ``benchmarks/RESULTS.md`` (creating it with its header); returns the path."""
    with open(RESULTS, "a") as f:
        if f.tell() == 0:
            f.write("# Benchmark results\n\nMeasured tables only; each section says when, where and how.\n")
        f.write(section)
    return RESULTS
