"""Running miles' own code in the Python 3.12 lane: where its sources are, and a child process that imports them.

miles is not on PyPI at the commit the recipes need (docs/miles.md), and it runs on the
radixark/Megatron-LM fork, whose ``megatron.core`` (0.16.0rc0 plus miles' changes, and a
``miles_megatron_plugins`` package it imports) is not the lane's megatron-core 0.19.2. So the
Makefile unpacks both source trees under ``.venv-py312/src-miles`` (``KIMI_MILES_SRC`` overrides):

    <root>/miles        radixark/miles at KIMI_MILES_COMMIT: miles/, miles_plugins/, train.py
    <root>/megatron-lm  radixark/Megatron-LM at KIMI_MEGATRON_COMMIT: megatron/, miles_megatron_plugins/

and every check here runs in a child process whose ``PYTHONPATH`` puts the fork first, the way
miles' image does (``PYTHONPATH=$MEGATRON_DIR``). The tests call :func:`run_check`; this file is
also the child's script (``python miles_lane.py CHECK JSON``), printing one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARK = "KIMI_MILES_LANE_RESULT "


def pinned() -> dict[str, str]:
    """The miles and Megatron-LM commits examples/common.sh pins."""
    text = (REPO / "examples" / "common.sh").read_text()
    out = {}
    for key in ("KIMI_MILES_COMMIT", "KIMI_MEGATRON_COMMIT"):
        m = re.search(rf"^{key}=([0-9a-f]{{40}})", text, re.M)
        assert m, f"examples/common.sh has no {key}"
        out[key] = m.group(1)
    return out


def source_root() -> Path:
    return Path(os.environ.get("KIMI_MILES_SRC") or REPO / ".venv-py312" / "src-miles")


def missing_sources() -> str | None:
    """Why miles' sources are not usable here, or None when both trees are unpacked at the pinned commits."""
    root, pins = source_root(), pinned()
    for sub, key, probe in (
        ("miles", "KIMI_MILES_COMMIT", "miles/utils/arguments.py"),
        ("megatron-lm", "KIMI_MEGATRON_COMMIT", "megatron/training/arguments.py"),
    ):
        tree = root / sub
        if not (tree / probe).is_file():
            return f"no {probe} under {tree} (make venv-py312 unpacks it; see the Makefile's py312 lane)"
        stamp = tree / ".commit"
        found = stamp.read_text().strip() if stamp.is_file() else "unknown"
        if found != pins[key]:
            return f"{tree} is at {found}, examples/common.sh pins {key}={pins[key]} (make venv-py312 refreshes it)"
    return None


def tiny_checkpoint(model: str, folder: Path) -> Path:
    """A weightless tiny ``model`` (k3, k31) folder: config.json, its remote-code module and the tokenizer."""
    from kimi_core.checkpoint.remote_config import write_remote_config
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.checkpoint.tokenizer import write_tokenizer

    cfg = tiny_config(model)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_remote_config(str(folder))
    text = cfg.get("text_config", cfg)
    write_tokenizer(folder, text["vocab_size"], text["max_position_embeddings"])
    return folder


def script_command(script: str, checkpoint: Path, knobs: dict) -> tuple[list[str], dict]:
    """train.py's arguments and the workers' environment (the ``export`` lines) as ``DRY_RUN=1 bash script``
    prints them, run as shipped against the lane's miles with the model sizes read from ``checkpoint``."""
    drop = ("DRY_RUN", "MILES_DIR", "EXTRA_ARGS", "HF_CHECKPOINT")
    base = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("K3")}
    env = {"MILES_DIR": str(source_root() / "miles"), "HF_CHECKPOINT": str(checkpoint), "DRY_RUN": "1", **knobs}
    cmd = f"source examples/common.sh && kimi_local_k3_sizes '{checkpoint}' && bash {script}"
    r = subprocess.run(["bash", "-c", cmd], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "lacks" not in r.stderr, r.stderr  # kimi_miles_require found every flag in the pinned miles
    lines = r.stdout.strip().splitlines()
    exports = [shlex.split(ln[len("export ") :])[0] for ln in lines if ln.startswith("export ")]
    workers = dict(e.split("=", 1) for e in exports)
    workers.pop("PYTHONPATH", None)  # the fork's path is the lane's own (child_env)
    words = shlex.split(lines[-1])
    return words[next(i for i, w in enumerate(words) if w.endswith("/train.py")) + 1 :], workers


def child_env(extra: dict | None = None) -> dict:
    root = source_root()
    path = [str(root / "megatron-lm"), str(root / "miles"), str(REPO), str(Path(__file__).parent)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(PYTHONPATH=os.pathsep.join(path), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def run_check(
    name: str, payload: dict, timeout: float = 300, cwd: str | os.PathLike | None = None, env: dict | None = None
) -> dict:
    """Run check ``name`` of this file in a child process with miles on the path; return its JSON result.

    :param env: more environment variables for the child (the launch script's ``kimi_env`` ones).

    :raises AssertionError: the child failed; the message holds its output.
    """
    proc = subprocess.run(
        [sys.executable, __file__, name, json.dumps(payload)],
        env=child_env(env),
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"miles check {name!r} failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def _emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


# --- checks, run in the child ------------------------------------------------------------------------


def parse_miles_args(argv: list[str]):
    """miles' ``parse_args`` (train.py's parser: Megatron's plus miles' plus ``--sglang-*``) on ``argv``."""
    import types

    import torch

    # Megatron's validate_args asks the GPU's compute capability (--moe-grouped-gemm needs >= 8, some
    # defaults depend on the architecture); the recipes' driver node has Hopper GPUs, this one none:
    # answer for an H200.
    h200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 * 2**30)
    torch.cuda.get_device_capability = lambda device=None: (h200.major, h200.minor)
    torch.cuda.get_device_properties = lambda device=None: h200
    sys.argv = ["train.py", *argv]
    from miles.utils.arguments import parse_args

    return parse_args()


def check_parse(payload: dict) -> dict:
    """For each of ``payload["runs"]`` (``{"argv", "env"}``, parsed one after the other in this process, each
    with its script's environment): the values of ``payload["keys"]`` in miles' parsed arguments."""
    out = []
    for run in payload["runs"]:
        saved = dict(os.environ)
        os.environ.update(run["env"])
        try:
            args = parse_miles_args(run["argv"])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out.append({k: _jsonable(getattr(args, k, None)) for k in payload["keys"]})
    return {"parsed": out}


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


CHECKS = {"parse": check_parse}


def main() -> None:
    name, payload = sys.argv[1], json.loads(sys.argv[2])
    if name not in CHECKS:
        import miles_hooks  # the hook checks live beside this file

        CHECKS.update(miles_hooks.CHECKS)
    _emit(CHECKS[name](payload))


if __name__ == "__main__":
    main()
