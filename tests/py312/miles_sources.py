"""Unpack miles and the Megatron-LM fork at the commits examples/common.sh pins, checked by git tree id.

Used by the Makefile's py312 lane (``make venv-py312``) to fill ``.venv-py312/src-miles`` (see
``miles_lane.py``). Each repository comes from, in order:

1. ``--git-dir`` style overrides: ``KIMI_MILES_GIT_DIR`` / ``KIMI_MEGATRON_GIT_DIR``, a local clone
   holding the pinned commit (``git archive``);
2. ``KIMI_MILES_TARBALL`` / ``KIMI_MEGATRON_TARBALL``, a local GitHub archive of the commit;
3. GitHub's archive of the commit (``https://github.com/<repo>/archive/<sha>.tar.gz``).

Whatever the source, only the paths the lane imports are kept, and each one's git object id (the
tree id of a folder, the blob id of a file, computed here from the unpacked files) must equal the
id recorded below for the pinned commit (``git rev-parse <sha>:<path>`` in any clone gives it), so
a wrong or altered archive is refused. Exit 0 and a ``.commit`` stamp per tree on success; exit 3
with one line saying why when no source could be read (the lane then skips its miles tests, saying so).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# repository -> (directory name under the destination, the pin's name in examples/common.sh,
#                {path kept: its git object id at the pinned commit})
TREES = {
    "radixark/miles": (
        "miles",
        "KIMI_MILES_COMMIT",
        {
            "miles": "61ce225cc0b35abe4f96a3f055546dc30f0c4a20",
            "miles_plugins": "df0cbe9d2296a01764242fc2958056109369d357",
            "train.py": "4e42fe292b3f3ea84738c4ce53416a3f98ffba01",
        },
    ),
    "radixark/Megatron-LM": (
        "megatron-lm",
        "KIMI_MEGATRON_COMMIT",
        {
            "megatron": "652788be06f3440e25977a907a6a7bd9acf15b1b",
            "miles_megatron_plugins": "970885143ddeec5fc26750049f9ccb06c08a041e",
        },
    ),
}
ENV = {"radixark/miles": "MILES", "radixark/Megatron-LM": "MEGATRON"}


def git_object_id(path: Path) -> str:
    """The git object id of a file (blob) or folder (tree) as ``git add`` would store it."""

    def obj(kind: str, data: bytes) -> bytes:
        return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).digest()

    def walk(p: Path) -> bytes:
        entries = []
        for child in p.iterdir():
            if child.is_symlink():
                entries.append((child.name, b"120000", obj("blob", os.readlink(child).encode())))
            elif child.is_dir():
                if child.name == "__pycache__":
                    continue
                entries.append((child.name + "/", b"40000", walk(child)))
            else:
                mode = b"100755" if os.access(child, os.X_OK) else b"100644"
                entries.append((child.name, mode, obj("blob", child.read_bytes())))
        entries.sort(key=lambda e: e[0].encode())  # git orders a folder as its name plus "/"
        body = b"".join(m + b" " + n.rstrip("/").encode() + b"\0" + h for n, m, h in entries)
        return obj("tree", body)

    if path.is_dir():
        return walk(path).hex()
    return obj("blob", path.read_bytes()).hex()


def _pins() -> dict[str, str]:
    text = (REPO / "examples" / "common.sh").read_text()
    return {k: re.search(rf"^{k}=([0-9a-f]{{40}})", text, re.M).group(1) for _, k, _ in TREES.values()}


def _archive_bytes(repo: str, sha: str, paths: list[str]) -> tuple[bytes, str]:
    key = ENV[repo]
    git_dir = os.environ.get(f"KIMI_{key}_GIT_DIR")
    if git_dir:
        out = subprocess.run(
            ["git", f"--git-dir={git_dir}", "archive", "--format=tar", f"--prefix=src-{sha}/", sha, *paths],
            capture_output=True,
            check=True,
        )
        return out.stdout, f"git archive of {git_dir}"
    tarball = os.environ.get(f"KIMI_{key}_TARBALL")
    if tarball:
        return Path(tarball).read_bytes(), tarball
    url = f"https://github.com/{repo}/archive/{sha}.tar.gz"
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.read(), url


def _unpack(data: bytes, paths: list[str], dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)  # the archive's single top folder comes first
            if len(parts) == 2 and any(parts[1] == p or parts[1].startswith(p + "/") for p in paths):
                m.name = parts[1]
                members.append(m)
        tar.extractall(dest, members=members, filter="tar")


def fetch(dest: Path) -> list[str]:
    """Fill ``dest/<name>`` for each repository; returns one line per tree saying where it came from."""
    pins, said = _pins(), []
    for repo, (name, pin, paths) in TREES.items():
        sha, out = pins[pin], dest / name
        stamp = out / ".commit"
        if stamp.is_file() and stamp.read_text().strip() == sha:
            said.append(f"{repo}@{sha}: already at {out}")
            continue
        data, origin = _archive_bytes(repo, sha, list(paths))
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest))
        try:
            _unpack(data, list(paths), tmp)
            for p, want in paths.items():
                got = git_object_id(tmp / p) if (tmp / p).exists() else "absent"
                if got != want:
                    raise SystemExit(f"miles_sources: {repo}@{sha}:{p} from {origin} has id {got}, expected {want}")
            (tmp / ".commit").write_text(sha + "\n")
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        said.append(f"{repo}@{sha}: {', '.join(paths)} from {origin}, ids checked")
    return said


def main() -> int:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / ".venv-py312" / "src-miles")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        for line in fetch(dest):
            print(line)
    except (OSError, subprocess.CalledProcessError) as e:
        print(
            f"miles_sources: could not read the pinned miles / Megatron-LM sources ({e}); set KIMI_MILES_GIT_DIR and "
            "KIMI_MEGATRON_GIT_DIR to local clones (or KIMI_*_TARBALL to GitHub archives) to run the miles tests",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
