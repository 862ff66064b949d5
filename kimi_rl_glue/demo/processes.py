"""The processes a command starts end with it, and a ``kill -9`` leaves none behind for long.

vLLM runs its engine core (and its workers) in child processes; when the command that started them is
killed with SIGKILL nothing in it runs, and they keep their memory until someone ends them. Three
defences, all Linux ``/proc`` based (elsewhere only the first two, over the children still attached):

1. :class:`ProcessLedger` makes the command the leader of its own process group when that does not take a
   terminal's Ctrl-C away from it (not the foreground job of a terminal), so every engine process it starts
   is in a group that holds nothing else.
2. On return, on an error and on SIGINT / SIGTERM / SIGHUP (:func:`install_signal_handlers` turns the last
   two into ``SystemExit``, so ``finally`` blocks run), :meth:`ProcessLedger.close` ends every descendant:
   SIGTERM, then SIGKILL after a grace period.
3. A pid file in the run folder (``.kimi-rl.pids.json``) records the command and, once the engine is up,
   each descendant with its start time and command line. The next run into that folder
   (:func:`end_leftovers`) ends the processes still alive whose pid, start time and command line match
   the record (a pid reused by an unrelated process does not), and the other members of the dead
   command's own process group.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from kimi_core.checkpoint.folders import FolderRefused
from kimi_core.checkpoint.writer import atomic_write_text

log = logging.getLogger(__name__)

PID_FILE = ".kimi-rl.pids.json"
#: seconds a process gets between SIGTERM and SIGKILL
GRACE_S = 5.0


def _stat(pid: int) -> tuple[int, int, int] | None:
    """``(ppid, pgrp, start time in clock ticks)`` of ``pid`` from ``/proc``, ``None`` if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _all_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for p in _all_pids():
        st = _stat(p)
        if st is not None:
            children.setdefault(st[0], []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _describe(pid: int) -> dict | None:
    st = _stat(pid)
    return None if st is None else {"pid": pid, "start": st[2], "cmdline": _cmdline(pid)}


def _matches(entry: dict) -> bool:
    """Whether the process ``entry`` recorded is still the same process (pid, start time and command line)."""
    now = _describe(entry["pid"])
    return now is not None and now["start"] == entry["start"] and now["cmdline"] == entry["cmdline"]


def end_processes(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those alive after ``grace_s``; returns the pids that were alive."""
    alive = [p for p in pids if _stat(p) is not None and p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline and any(_stat(p) is not None for p in alive):
            _reap()
            time.sleep(0.05)
        if all(_stat(p) is None for p in alive):
            break
    _reap()
    return alive


def _reap() -> None:
    """Collect exited children of this process, so they do not linger as zombies."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_leftovers(run_dir: str, flag: str = "--out") -> list[int]:
    """End what a killed earlier command in ``run_dir`` left running; returns the pids ended.

    :raises FolderRefused: the command that wrote the pid file is still running (same pid, start time and
        command line): two runs must not share a folder.
    """
    path = os.path.join(run_dir, PID_FILE)
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, json.JSONDecodeError):
        return []
    leader = rec.get("command", {})
    if leader.get("pid") != os.getpid() and leader and _matches(leader):
        raise FolderRefused(
            f"{flag} {run_dir}: another run (pid {leader['pid']}: {leader['cmdline'][:80]}) is "
            "still using this folder; wait for it, end it, or name another folder"
        )
    victims = {e["pid"] for e in rec.get("children", []) if _matches(e)}
    pgid = rec.get("own_group")
    if pgid:  # the dead command led its own group: every member left is one of its processes
        for p in _all_pids():
            st = _stat(p)
            if st is not None and st[1] == pgid and st[2] >= leader.get("start", 0) and p != os.getpid():
                victims.add(p)
    ended = end_processes(sorted(victims))
    if ended:
        log.warning(
            "ended %d process(es) a killed earlier run in %s left running: %s",
            len(ended),
            run_dir,
            ", ".join(map(str, ended)),
        )
    os.remove(path)
    return ended


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, so cleanup runs as for Ctrl-C."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def _foreground_of_terminal() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


class ProcessLedger:
    """The processes this command starts, recorded in ``<run_dir>/.kimi-rl.pids.json`` and ended on close.

    Use as a context manager around everything that may start processes::

        with ProcessLedger(out) as ledger:
            rollout = VllmRollout(...)
            ledger.record()  # the engine's processes, for the next run if this one is killed
    """

    def __init__(self, run_dir: str, lead_group: bool = True):
        """:param lead_group: make this process its own process group's leader where that is safe (the command's
        entry point does; a library caller or a test runner keeps its group)."""
        self.run_dir = run_dir
        self.own_group = None
        if lead_group and os.getpgrp() != os.getpid() and not _foreground_of_terminal():
            try:
                os.setpgid(0, 0)
            except OSError:
                pass
        if lead_group and os.getpgrp() == os.getpid():
            self.own_group = os.getpid()

    def record(self) -> None:
        """Write the pid file: this command and its living descendants."""
        rec = {
            "command": _describe(os.getpid()),
            "own_group": self.own_group,
            "children": [d for d in map(_describe, descendants(os.getpid())) if d is not None],
        }
        atomic_write_text(os.path.join(self.run_dir, PID_FILE), json.dumps(rec, indent=1))

    def close(self) -> list[int]:
        """End every descendant still alive and remove the pid file; returns the pids ended."""
        ended = end_processes(descendants(os.getpid()))
        try:
            os.remove(os.path.join(self.run_dir, PID_FILE))
        except FileNotFoundError:
            pass
        return ended

    def __enter__(self):
        self.record()
        return self

    def __exit__(self, *exc):
        self.close()
