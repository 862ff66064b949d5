"""Read a JSON file of a checkpoint or adapter directory, with errors that name the file."""

from __future__ import annotations

import json
import os


def read_json_file(
    path: str | os.PathLike, filename: str, error: type[Exception], missing: str = "not found"
) -> tuple[str, dict]:
    """``(file path, parsed JSON)`` of ``path`` (a directory holding ``filename``, or the file itself).

    :param error: the exception class raised (message starts with the file path).
    :param missing: what to say when the file does not exist.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, filename)
    try:
        with open(p) as f:
            return p, json.load(f)
    except FileNotFoundError:
        raise error(f"{p}: {missing}") from None
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e})") from None
