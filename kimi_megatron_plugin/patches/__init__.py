"""The ledger of every patch this plugin applies to megatron-core, Megatron-Bridge or torch on their behalf.

One file per patch, each holding the code and its ledger row ``ENTRY`` (a
:class:`kimi_core.patch_ledger.PatchEntry`: target, host releases ``versions``, why, how, upstream, removal
condition, what the target must look like), named as its file; :data:`LEDGER` collects the rows. Each patch checks its row (:func:`check`) right before it is applied, so a host release that moves or
changes a target fails at startup naming the row. Where each one is applied:

================================  ==============================================================================
row / file                        applied
================================  ==============================================================================
``cpu_current_device``            processes without CUDA: :func:`apply_cpu_shims` (:mod:`kimi_megatron_plugin.
                                  cpu_parallel`, ``kimi_rl_glue.miles.init``)
``mla_have_te``                   every process, when :mod:`kimi_megatron_plugin.models.layers` is imported
``router_te_general_gemm``        every process, when :mod:`kimi_megatron_plugin.models.layers` is imported
``te_stub``                       before megatron-bridge is imported without TransformerEngine
                                  (:func:`kimi_megatron_plugin.bridge.import_bridge`)
================================  ==============================================================================
"""

from __future__ import annotations

from kimi_core.patch_ledger import PatchEntry, check_patch
from kimi_megatron_plugin.host_support import host_release
from kimi_megatron_plugin.patches import cpu_current_device, mla_have_te, router_te_general_gemm, te_stub

__all__ = [
    "LEDGER",
    "check",
    "host_release",
    "apply_cpu_shims",
    "remove_cpu_shims",
    "cpu_shims_active",
    "apply_no_te_shims",
    "te_stub",
]

#: row name (= the patch's file name) -> its ledger entry, in the order of the table above
LEDGER: dict[str, PatchEntry] = {
    m.ENTRY.name: m.ENTRY for m in (cpu_current_device, mla_have_te, router_te_general_gemm, te_stub)
}


def check(name: str, *, target_obj=None) -> None:
    """Check ledger row ``name`` against the installed host release and target (see :func:`check_patch`).

    :param target_obj: the target to inspect instead of resolving it (a patch that has already replaced the
        symbol passes the original it kept; ``te_stub`` passes the module's spec, found without importing it).
    :raises kimi_core.errors.PatchTargetError: naming the row, the target and what differs.
    """
    entry = LEDGER[name]
    check_patch(entry, host_release(entry.host), target_obj=target_obj)


def apply_cpu_shims() -> bool:
    """``cpu_current_device`` (only without CUDA, idempotent); True when it is active."""
    return cpu_current_device.apply()


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims` (tests)."""
    cpu_current_device.remove()


def cpu_shims_active() -> bool:
    return cpu_current_device.active()


def apply_no_te_shims() -> bool:
    """``mla_have_te`` and ``router_te_general_gemm`` (idempotent; CPU or GPU); True when either changed something."""
    changed_mla = mla_have_te.apply()
    changed_router = router_te_general_gemm.apply()
    return changed_mla or changed_router
