"""Make the working tree's plugins discoverable by entry point in a staged site folder (GPU machine).

The GPU machine gets the hosts staged into a site folder (by the hosts' ``stage_*.sh`` scripts) and this
repository as a plain working tree on ``PYTHONPATH``; vLLM and SGLang find plugins only through
installed distributions' entry points. This writes one minimal ``<name>-<version>.dist-info``
(``METADATA`` + ``entry_points.txt``) per member distribution (each package folder's
``pyproject.toml``), so ``VLLM_PLUGINS=kimi`` / ``SGLANG_PLUGINS=kimi`` load the tree's code.

Usage: ``python3 tools/gpu/write_entry_points.py /tmp/site`` (run from the repository root).
"""

from __future__ import annotations

import glob
import os
import sys
import tomllib


def write(site: str, root: str = ".") -> dict[str, dict[str, list[str]]]:
    """Write the dist-info folders; returns ``{distribution: {group: [entry point names]}}``."""
    out = {}
    for pp in sorted(glob.glob(os.path.join(root, "*", "pyproject.toml"))):
        project = tomllib.load(open(pp, "rb"))["project"]
        eps = project.get("entry-points", {})
        d = os.path.join(site, f"{project['name'].replace('-', '_')}-{project['version']}.dist-info")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
        with open(os.path.join(d, "entry_points.txt"), "w") as f:
            f.write("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items()) for g, m in eps.items()))
        out[project["name"]] = {g: list(m) for g, m in eps.items()}
    return out


if __name__ == "__main__":
    print("entry points:", write(sys.argv[1]))
