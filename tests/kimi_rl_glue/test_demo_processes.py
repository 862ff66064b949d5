"""Processes a command starts end with it: on SIGTERM, and, after a SIGKILL, on the next run into its folder
(:mod:`kimi_rl_glue.demo.processes`); and the real demo killed midway leaves nothing running or mixed."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from kimi_rl_glue.demo import processes
from kimi_rl_glue.demo.processes import PID_FILE, ProcessLedger, end_leftovers

# a command that starts two grandchildren-to-be (sleep) under a ProcessLedger and waits
_COMMAND = r"""
import subprocess, sys, time
from kimi_rl_glue.demo.processes import ProcessLedger, install_signal_handlers
install_signal_handlers()
with ProcessLedger(sys.argv[1]) as ledger:
    kids = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    ledger.record()
    print("ready", flush=True)
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    return processes._stat(pid) is not None


def _start(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _COMMAND, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    with open(tmp_path / PID_FILE) as f:
        kids = [c["pid"] for c in json.load(f)["children"]]
    assert len(kids) == 2 and all(map(_alive, kids))
    return p, kids


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_sigterm_ends_the_command_and_its_processes(tmp_path):
    """SIGTERM: the command exits 143 after ending every process it started, and removes its pid file."""
    p, kids = _start(tmp_path)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert _wait_gone(kids) == []
    assert not (tmp_path / PID_FILE).exists()


def test_next_run_ends_what_a_sigkill_left(tmp_path):
    """After SIGKILL the processes live on; the next run into the folder ends exactly them, and never a process
    whose pid matches but whose start time does not (a reused pid)."""
    p, kids = _start(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert all(map(_alive, kids))  # what the issue saw: left running
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        with open(tmp_path / PID_FILE) as f:
            rec = json.load(f)
        rec["children"].append({"pid": bystander.pid, "start": 1, "cmdline": "sleep 300"})  # reused pid
        (tmp_path / PID_FILE).write_text(json.dumps(rec))
        assert sorted(end_leftovers(str(tmp_path))) == sorted(kids)
        assert _wait_gone(kids) == [] and bystander.poll() is None
        assert not (tmp_path / PID_FILE).exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_running_command_keeps_its_folder(tmp_path):
    """A second run into a folder whose command is still running is refused, naming its pid; nothing is ended."""
    from kimi_core.checkpoint.folders import FolderRefused

    p, kids = _start(tmp_path)
    try:
        with pytest.raises(FolderRefused, match=f"pid {p.pid}"):
            end_leftovers(str(tmp_path))
        assert all(map(_alive, kids))
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    assert _wait_gone(kids) == []


def test_ledger_close_ends_descendants(tmp_path):
    """In-process: close() ends the children the command started and removes the pid file."""
    ledger = ProcessLedger(str(tmp_path), lead_group=False)  # the test runner keeps its process group
    ledger.record()
    kid = subprocess.Popen(["sleep", "300"])
    assert kid.pid in ledger.close()
    assert kid.wait(timeout=10) is not None and not (tmp_path / PID_FILE).exists()


DEMO = [
    sys.executable,
    "-m",
    "kimi_rl_glue.cli",
    "demo",
    "--trainer",
    "reference",
    "--prompts",
    "2",
    "--group",
    "2",
    "--max-tokens",
    "4",
]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm(-cpu) not installed")
def test_demo_killed_midway_rerun_recovers(tmp_path):
    """A demo SIGKILLed once its vLLM engine is up leaves the engine running; the rerun with --overwrite ends it,
    starts clean (one run's files only), prints one line per stage and the log's path (no host noise), and
    leaves no process of its own behind."""
    out = tmp_path / "run"
    p = subprocess.Popen(
        [*DEMO, "--steps", "2", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    kids = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None and not kids:
        try:
            with open(out / PID_FILE) as f:
                kids = [c["pid"] for c in json.load(f)["children"]]
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    assert kids, "the demo never recorded its engine processes"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert any(map(_alive, kids))  # the engine outlived the demo

    seen: set[int] = set()
    done = threading.Event()

    def watch():  # the rerun's own engine processes, from its pid file
        while not done.wait(0.2):
            try:
                with open(out / PID_FILE) as f:
                    seen.update(c["pid"] for c in json.load(f)["children"])
            except (OSError, ValueError):
                pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    r = subprocess.run(
        [*DEMO, "--steps", "1", "--overwrite", "--out", str(out)], capture_output=True, text=True, timeout=900
    )
    done.set()
    t.join()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _wait_gone(kids) == []
    assert seen and _wait_gone(sorted(seen)) == []
    assert not (out / PID_FILE).exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert json.load(open(out / "summary.json"))["steps"] == 1
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["v000001"]
    # readable: our lines only, the host's output in the log
    assert "FLAGGED" not in r.stdout and "INFO" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert f"{out}/demo.log" in r.stdout and (out / "demo.log").stat().st_size > 0
    assert len(r.stdout.splitlines()) < 25, r.stdout
