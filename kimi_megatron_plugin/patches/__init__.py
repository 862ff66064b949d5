"""The ledger of every patch this plugin applies to megatron-core, Megatron-Bridge or torch on their behalf.

One :class:`kimi_core.patch_ledger.PatchEntry` row per patch in :data:`LEDGER` (target, host releases,
why, how, upstream, removal condition, what the target must look like), one file per patch, named as its
row. Each patch checks its row (:func:`check`) right before it is applied, so a host release that moves or
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
from kimi_megatron_plugin.host_support import MEGATRON_BRIDGE, MEGATRON_CORE, host_release
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

_PR_6270 = "NVIDIA/Megatron-LM#6270 (avoid MCore CUDA assumptions in CPU-only model conversion)"

#: row name (= the patch's file name) -> its ledger entry
LEDGER: dict[str, PatchEntry] = {
    e.name: e
    for e in (
        PatchEntry(
            name="cpu_current_device",
            target="torch.cuda.current_device",
            host=MEGATRON_CORE.distribution,
            versions=MEGATRON_CORE.releases,
            why="TopKRouter and (YaRN) RotaryEmbedding allocate on torch.cuda.current_device(); a CPU has no CUDA",
            how="replace torch.cuda.current_device by a function returning 'cpu', only when CUDA is absent; "
            "cpu_current_device.remove() undoes it",
            upstream=_PR_6270,
            remove_when="megatron-core takes the device from the config on CPU",
            expect="signature:() -> int",
        ),
        PatchEntry(
            name="mla_have_te",
            target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
            host=MEGATRON_CORE.distribution,
            versions=MEGATRON_CORE.releases,
            why="HAVE_TE is True without TE (mock classes), so MLA's isinstance(linear_proj, TELinear) raises",
            how="set HAVE_TE = False when TELinear is not a class",
            upstream=_PR_6270,
            remove_when="megatron-core sets HAVE_TE from a real TE import",
            expect="type:bool",
        ),
        PatchEntry(
            name="router_te_general_gemm",
            target="megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward",
            host=MEGATRON_CORE.distribution,
            versions=MEGATRON_CORE.releases,
            why="forward tests te_general_gemm, a name bound only when TE imports: NameError without TE",
            how="bind moe_utils.te_general_gemm = None when absent (megatron takes its torch matmul path)",
            upstream=_PR_6270,
            remove_when="megatron-core binds te_general_gemm without TE",
            expect="reads:te_general_gemm",
        ),
        PatchEntry(
            name="te_stub",
            target="megatron.bridge.peft.lora_layers",
            host=MEGATRON_BRIDGE.distribution,
            versions=MEGATRON_BRIDGE.releases,
            why="lora_layers imports transformer_engine unguarded and sits on megatron.bridge's own import chain",
            how="a meta-path finder puts placeholder transformer_engine modules in sys.modules only while that one "
            "module executes, so HAVE_TE stays False everywhere else",
            upstream="none yet (a guarded TE import in megatron-bridge's peft/lora_layers.py would remove it)",
            remove_when="megatron-bridge imports without TransformerEngine",
            expect="type:ModuleSpec",
        ),
    )
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
