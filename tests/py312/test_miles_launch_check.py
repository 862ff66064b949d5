"""The miles launch scripts refuse a miles without the flags they pass, first and in one line (examples/common.sh
``kimi_miles_require``), naming the flag and the commit docs/miles.md pins. Needs only bash: runs in any lane.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
K3 = "examples/miles/run_kimi_k3_lora.sh"
K31 = "examples/miles/run_kimi_k31_w4a16_lora_32xh200.sh"
K31_B300 = "examples/miles/run_kimi_k31_w4a16_lora_16xb300.sh"


def _pinned_commit() -> str:
    """The radixark/miles commit of docs/miles.md's table."""
    m = re.search(r"\| radixark/miles \| `([0-9a-f]{40})`", (REPO / "docs" / "miles.md").read_text())
    assert m, "docs/miles.md names no radixark/miles commit"
    return m.group(1)


def _miles(tmp_path: Path, *flags: str) -> Path:
    """A miles checkout whose argument parser defines exactly ``flags`` (besides an ordinary one)."""
    src = tmp_path / "miles" / "miles" / "utils"
    src.mkdir(parents=True)
    lines = ["def add(parser):", '    parser.add_argument("--lora-rank", type=int)']
    lines += [f'    parser.add_argument("{f}", type=str)' for f in flags]
    (src / "arguments.py").write_text("\n".join(lines) + "\n")
    return tmp_path / "miles"


def _run(script: str, miles: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "MILES_DIR", "EXTRA_ARGS")}
    return subprocess.run(
        ["bash", str(REPO / script)],
        env={**base, "MILES_DIR": str(miles), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("script", [K3, K31, K31_B300])
def test_miles_without_lora_provider_fails_first(tmp_path, script):
    """A stock miles (no --lora-provider-path): exit 2 before anything is printed, one line naming flag and commit."""
    r = _run(script, _miles(tmp_path))
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "--lora-provider-path" in lines[0] and _pinned_commit() in lines[0] and "docs/miles.md" in lines[0]


def test_k31_needs_only_the_native_lora_miles(tmp_path):
    """PR #1792's miles (--lora-provider-path, no --rollout-top-logprobs-num) runs the K3.1 script: the top-K
    flag comes from our --custom-generate-function-path (kimi_rl_glue.miles.topk_rollout), not from miles."""
    r = _run(K31, _miles(tmp_path, "--lora-provider-path"), DRY_RUN="1")
    assert r.returncode == 0 and "lacks" not in r.stderr, r.stderr
    assert "--custom-generate-function-path kimi_rl_glue.miles.topk_rollout.generate" in r.stdout
    assert "--rollout-top-logprobs-num 128" in r.stdout


def test_supported_miles_passes_and_dry_run_only_warns(tmp_path):
    """With the flags present the check is silent; under DRY_RUN=1 a missing flag is a warning and the command
    is still printed."""
    ok = _run(K3, _miles(tmp_path / "a", "--lora-provider-path"), DRY_RUN="1")
    assert ok.returncode == 0 and "lacks" not in ok.stderr and "# command:" in ok.stdout
    warn = _run(K31, _miles(tmp_path / "b"), DRY_RUN="1")
    assert warn.returncode == 0 and "# command:" in warn.stdout
    assert "warning:" in warn.stderr and "--lora-provider-path" in warn.stderr
