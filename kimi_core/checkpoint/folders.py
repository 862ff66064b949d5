"""Which output folders a command may write into: never its input, never inside it, never a file.

``kimi-rl dequantize --input X --output X`` once rewrote X's ``config.json`` and index as BF16 before
failing: the 4-bit source was lost. Every command that writes a folder from another one checks the pair
here first, before any byte is written.
"""

from __future__ import annotations

import os

from kimi_core.errors import KimiError


class FolderRefused(KimiError, ValueError):
    """An output folder the command will not write into; the message names the flag and the folder.

    A usage error (the CLI exits 2): nothing has been written when it is raised.
    """


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def is_within(inner: str | os.PathLike, outer: str | os.PathLike) -> bool:
    """Whether ``inner`` is ``outer`` or lies below it, after resolving symlinks."""
    a, b = _real(inner), _real(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_output_folder(
    output: str | os.PathLike, flag: str, input_dir: str | os.PathLike | None = None, input_flag: str = "--input"
) -> str:
    """Refuse ``output`` when it names a file, equals or lies inside ``input_dir``, or contains ``input_dir``.

    :param flag: the flag that named ``output`` (``"--output"``, ``"--out"``), quoted in the error.
    :returns: ``output`` as a string.
    :raises FolderRefused: nothing was written.
    """
    out = os.fspath(output)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise FolderRefused(f"{flag} {out}: is a file, not a folder; name a new or existing folder")
    if input_dir is not None:
        if _real(out) == _real(input_dir):
            raise FolderRefused(
                f"{flag} {out} is the same folder as {input_flag} {os.fspath(input_dir)}: writing "
                f"there would overwrite the input; name another folder"
            )
        if is_within(out, input_dir):
            raise FolderRefused(
                f"{flag} {out} lies inside {input_flag} {os.fspath(input_dir)}: the input would "
                f"change under the command; name a folder outside it"
            )
        if is_within(input_dir, out):
            raise FolderRefused(
                f"{input_flag} {os.fspath(input_dir)} lies inside {flag} {out}: writing the output "
                f"could replace the input; name a folder that does not contain it"
            )
    return out
