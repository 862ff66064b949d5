"""What ``kimi-rl demo`` shows: its own lines and one progress bar; the hosts' output goes to a log file.

vLLM, Megatron, TransformerEngine, Triton and the engine processes write INFO lines, warnings and
tracebacks they recover from straight to file descriptors 1 and 2, from this process and from the
engine processes it starts (which inherit them). :func:`demo_console` points both descriptors at
``<run>/demo.log`` for the length of the run and hands back streams on the original terminal for the
demo's own lines (``--verbose`` keeps everything on the terminal instead).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TextIO

LOG_NAME = "demo.log"


@dataclass
class Console:
    """Where the demo writes: ``out`` (its lines), ``err`` (the progress bar, errors), ``log_path`` (the hosts'
    output, ``None`` with ``--verbose``)."""

    out: TextIO
    err: TextIO
    log_path: str | None = None

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


@contextlib.contextmanager
def demo_console(run_dir: str, verbose: bool):
    """Yield a :class:`Console`; unless ``verbose``, file descriptors 1 and 2 go to ``<run_dir>/demo.log`` meanwhile."""
    if verbose:
        yield Console(sys.stdout, sys.stderr)
        return
    path = os.path.join(run_dir, LOG_NAME)
    for s in (sys.stdout, sys.stderr):
        s.flush()
    saved = [os.dup(1), os.dup(2)]
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    err = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield Console(out, err, path)
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                s.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        out.close()
        err.close()
