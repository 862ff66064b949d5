"""The one convention for host patches: a ledger entry per patch, checked before the patch is applied.

A :class:`PatchEntry` records the host symbol a plugin replaces (``target``, a dotted path), the host
releases it was checked on (``versions``, a PEP 440 specifier of the host named by ``host``), why it is
needed, how it works, the upstream issue or PR and the condition to remove it, plus ``expect``: what the
target must look like for the patch to be right. :func:`check_patch` resolves the target and compares it
with ``expect``; a missing or changed target raises :class:`~kimi_core.errors.PatchTargetError` naming the
entry, so a host upgrade that moves or fixes the target is caught at startup instead of silently patching
the wrong thing. ``expect`` forms:

* ``"exists"``: the target resolves;
* ``"signature:(...)"``: ``str(inspect.signature(target))`` equals the text after the colon;
* ``"reads:NAME"``: the target is a function whose code reads the global ``NAME``;
* ``"type:NAME"``: ``type(target).__name__`` is ``NAME``.

Each plugin keeps one ledger in its ``patches`` package: :mod:`kimi_vllm_plugin.patches`,
:mod:`kimi_sglang_plugin.patches` (``HookPatch`` rows, a subclass that also records SGLang's hook type and the
targets recorded per release) and :mod:`kimi_megatron_plugin.patches`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from kimi_core.errors import PatchTargetError

__all__ = ["PatchEntry", "check_patch", "resolve_target"]


@dataclass(frozen=True)
class PatchEntry:
    """One ledger row; see the module docstring for ``expect``."""

    name: str
    target: str
    host: str  # distribution whose releases ``versions`` constrains (e.g. "megatron-core")
    versions: str  # PEP 440 specifier of the host releases checked, e.g. ">=0.16.1,<0.20"
    why: str
    how: str
    upstream: str
    remove_when: str
    expect: str = "exists"


def resolve_target(target: str, *, override: object | None = None) -> object:
    """The object at dotted ``target`` (longest importable module prefix, then attributes).

    Raises :class:`PatchTargetError` naming the target and the first missing part.
    """
    if override is not None:
        return override
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                raise PatchTargetError(f"{target}: {'.'.join(parts[:j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise PatchTargetError(f"{target}: no importable module prefix")


def check_patch(entry: PatchEntry, release: str | None = None, *, target_obj=None) -> None:
    """Raise :class:`PatchTargetError` unless ``entry``'s target is what the ledger recorded.

    :param release: the running ``entry.host`` release; checked against ``entry.versions`` when given.
    :param target_obj: the target to inspect instead of resolving it (a patch that has already replaced
        the symbol passes the original it kept).
    """
    where = f"patch ledger entry {entry.name!r} (target {entry.target})"
    if release is not None:
        from packaging.specifiers import SpecifierSet

        if release not in SpecifierSet(entry.versions):
            raise PatchTargetError(
                f"{where}: {entry.host} {release} is outside the checked releases "
                f"{entry.versions}; re-check the target, then widen the ledger entry"
            )
    obj = resolve_target(entry.target, override=target_obj)
    kind, _, want = entry.expect.partition(":")
    if kind == "exists":
        return
    if kind == "signature":
        got = str(inspect.signature(obj))
        if got != want:
            raise PatchTargetError(f"{where}: signature {got}, the ledger recorded {want}")
    elif kind == "reads":
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if code is None or want not in code.co_names:
            raise PatchTargetError(f"{where}: no longer reads {want!r} ({entry.remove_when}?)")
    elif kind == "type":
        if type(obj).__name__ != want:
            raise PatchTargetError(f"{where}: is a {type(obj).__name__}, the ledger recorded {want}")
    else:
        raise ValueError(f"{where}: unknown expect {entry.expect!r}")
