"""Reads an unpacked SGLang wheel (no import: another release's code need not import here) into the
terms of ``kimi_sglang_plugin.host_support``: kind, parameter names, dataclass fields, ``file:line``.

Used by ``test_host_support.py`` to check the recorded rows of a release that is not installed
(``KIMI_SGLANG_SRC_0517=<dir holding sglang/>``), by parsing with :mod:`ast`.
"""

from __future__ import annotations

import ast
import os

from kimi_sglang_plugin.host_support import ABSENT, Fact

__all__ = ["source_fact"]


def _module_file(root: str, parts: list[str]) -> tuple[str, list[str]] | None:
    """The longest prefix of ``parts`` that is a module file under ``root``, and the rest."""
    for i in range(len(parts), 0, -1):
        base = os.path.join(root, *parts[:i])
        for f in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(f):
                return f, parts[i:]
    return None


def _find(body: list, name: str):
    """The def / class / assignment / import binding ``name`` in ``body``, looking into if/try blocks
    (a module-level ``if _is_cuda: from ... import x`` binds ``x``)."""
    todo = list(body)
    while todo:
        n = todo.pop(0)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return n
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return n
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return n
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in n.names):
            return n
        if isinstance(n, (ast.If, ast.Try)):
            todo += n.body + n.orelse + [x for h in getattr(n, "handlers", []) for x in h.body]
    return None


def _inherited(root: str, path: str, module, cls: ast.ClassDef, name: str, depth: int = 0):
    """``(file, its module, node)`` of ``name`` inherited by ``cls`` (a class of ``module``, parsed from ``path``):
    its bases looked up in the same module or through its ``from sglang... import Base``; node ``None`` if none."""
    for base in cls.bases:
        if not isinstance(base, ast.Name) or depth > 4:
            continue
        bpath, bmod = path, module
        bnode = _find(module.body, base.id)
        if isinstance(bnode, ast.ImportFrom) and bnode.module and bnode.module.startswith("sglang"):
            found = _module_file(root, bnode.module.split("."))
            if found is None or found[1]:
                continue
            bpath = found[0]
            bmod = ast.parse(open(bpath).read(), bpath)
            bnode = _find(bmod.body, base.id)
        if not isinstance(bnode, ast.ClassDef):
            continue
        got = _find(bnode.body, name)
        if got is not None:
            return bpath, bmod, got
        deeper = _inherited(root, bpath, bmod, bnode, name, depth + 1)
        if deeper[2] is not None:
            return deeper
    return path, module, None


def _params(node) -> tuple[str, ...]:
    a = node.args
    out = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    out += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return tuple(out)


def source_fact(root: str, symbol: str, expect: Fact | None = None) -> Fact:
    """:class:`Fact` of dotted ``symbol`` in the source tree ``root`` (the folder holding ``sglang/``)."""
    found = _module_file(root, symbol.split("."))
    if found is None:
        return ABSENT
    path, rest = found
    module = node = ast.parse(open(path).read(), path)
    for name in rest:
        owner = node
        node = _find(getattr(node, "body", []), name)
        if node is None and isinstance(owner, ast.ClassDef):
            path, module, node = _inherited(root, path, module, owner, name)
        if node is None:
            return ABSENT
    where = f"{os.path.relpath(path, os.path.join(root, 'sglang'))}:{getattr(node, 'lineno', 0)}"
    if isinstance(node, ast.ClassDef):
        if expect is not None and expect.kind == "fields":
            have = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            return Fact(where, "fields", tuple(n for n in expect.params if n in have))
        return Fact(where, "class")
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Fact(where, "function", _params(node))
    return Fact(where, "attr")
