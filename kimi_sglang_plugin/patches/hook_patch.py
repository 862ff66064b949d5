"""The row type of SGLang's patch ledger, :class:`HookPatch`, and the release ranges the rows use.

Not a patch: every patch file of this package builds its rows from here, and
:mod:`kimi_sglang_plugin.patches` collects them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_core.patch_ledger import PatchEntry
from kimi_sglang_plugin.host_support import SUPPORTED_SGLANG

__all__ = [
    "BOTH",
    "HOST",
    "ONLY_0517",
    "ONLY_0523",
    "PR_37704",
    "HookPatch",
    "covered_releases",
    "release_tag",
]

#: the distribution whose release a row's ``versions`` constrains
HOST = "sglang"
#: ``versions`` of a row for both supported releases (the ones between are refused by host_support first)
BOTH = ">=0.5.17,<=0.5.23"
ONLY_0517 = "==0.5.17"
ONLY_0523 = "==0.5.23"
#: "Kimi K3 colocated RL: LoRA fixes and in-place MXFP4 Marlin reload", open against ``sglang-miles``
PR_37704 = "sgl-project/sglang#37704"


def release_tag(release: str) -> str:
    """``"0.5.17"`` -> ``"0517"``: the name suffix of a row that is one release's variant of a patch."""
    _, minor, micro = release.split(".")
    return f"{int(minor):02d}{int(micro):02d}"


def covered_releases(entry: PatchEntry) -> tuple[str, ...]:
    """The supported SGLang releases inside ``entry.versions``."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(entry.versions)
    return tuple(r for r in SUPPORTED_SGLANG if r in spec)


@dataclass(frozen=True)
class HookPatch(PatchEntry):
    """A ledger row applied through ``HookRegistry``.

    ``name`` is ``<file>`` (the module of this package holding the row and the hook), ``<file>.<part>`` where
    the file holds several hooks, plus ``-<release tag>`` (``-0517``, ``-0523``) where a patch needs different
    code per release: one row per variant, disjoint ``versions``.

    :param hook: the ``HookType`` value: ``"before"``, ``"after"``, ``"around"`` or ``"replace"``.
    :param fn: ``"module:function"`` of our hook.
    :param absent_in: why the patch does not apply to the supported releases its ``versions`` leave out.
    """

    hook: str = "around"
    fn: str = ""
    absent_in: str = ""

    @property
    def key(self) -> str:
        """``name@release+release``: unique across the ledger."""
        return f"{self.name}@{'+'.join(covered_releases(self))}"

    @property
    def patch(self) -> str:
        """The patch this row is (a release variant of): :attr:`name` without its ``-<release tag>``."""
        return self.name.partition("-")[0]

    @property
    def file(self) -> str:
        """The module of :mod:`kimi_sglang_plugin.patches` holding this row and its hook."""
        return self.patch.partition(".")[0]

    def hook_type(self):
        """SGLang's ``HookType`` of :attr:`hook`."""
        from sglang.srt.plugins.hook_registry import HookType

        return HookType(self.hook)
