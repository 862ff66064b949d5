"""Every patch this plugin applies to SGLang, through SGLang's own ``HookRegistry``: one file per patch, each
holding the hook code and its ledger row(s).

A row is a :class:`~kimi_sglang_plugin.patches.hook_patch.HookPatch`: a
:class:`kimi_core.patch_ledger.PatchEntry` (target, ``versions``, why, how, the upstream issue or PR, the
condition to remove it) plus what ``HookRegistry`` needs, the hook type and our hook function. The convention
of every patch file: one row is ``ENTRY = HookPatch(...)``; several rows (a file with several hooks, or one
variant per release) are ``ENTRIES = (HookPatch(...), ...)``. A row is named after its file: ``<file>``,
``<file>.<part>`` where the file holds several hooks, plus ``-0517`` / ``-0523`` where a patch needs different
code per release (one row per variant, disjoint ``versions``). Where a bug is absent in a supported release
the row's ``versions`` leave it out and ``absent_in`` says why. Upstream PR numbers live in ``upstream``.
:data:`LEDGER` lists the files below and collects their rows, in this order (the order hooks are registered):

============================  ==================================================================================
file                          what
============================  ==================================================================================
``k31_dsa_gates``             SGLang sees K3.1 as K3 + DSA (config gate, index head dim, model class)
``lora_shared_experts_alias`` sgl-project/sglang#37704 item 1: shared-expert LoRA buffers from K3's field
``lora_output_gate``          #37704 item 2: the MLA output gate survives LoRA on ``o_proj`` (per release)
``lora_latent_expert_width``  #37704 item 3: routed-expert LoRA buffers at the latent width
``lora_params_dtype``         #37704 item 4: a LoRA wrapper shows ``params_dtype`` (0.5.23)
``kda_f_b_proj_alias``        #37704 item 5: ``f_b_proj.weight`` keeps its parameter name (0.5.23)
``moe_lora_marlin``           MoE LoRA on MXFP4 + SiTU experts (pieces in :mod:`kimi_sglang_plugin.moe_lora`)
``attn_residual_width``       attention residuals at any ``hidden_size``
``routed_experts_capture``    ``--enable-return-routed-experts`` on K3 (0.5.17)
``lora_unfused_front``        K3's MoE front stays unmerged with LoRA on, so shared-expert LoRA applies
``hybrid_indexer_metadata``   K3.1's DSA indexer gets its metadata through the hybrid backend (0.5.17)
``checksum_refusal``          an adapter failing SGLang's sha256 check is refused, not fatal
============================  ==================================================================================

:mod:`.hook_patch` (the row type and release ranges) and :mod:`.config_alias` (a helper of two patches) are
not patches. What each supported release has at each target is recorded data
(:data:`kimi_sglang_plugin.host_support.FACTS`). :func:`check_hook_patch` is
:func:`kimi_core.patch_ledger.check_patch` plus that record: a target missing, changed, or without a row for
the running release raises :class:`~kimi_core.errors.PatchTargetError` naming the row, before anything is
patched.
"""

from __future__ import annotations

import importlib

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import check_patch
from kimi_sglang_plugin.host_support import FACTS, compare
from kimi_sglang_plugin.patches import (
    attn_residual_width,
    checksum_refusal,
    hybrid_indexer_metadata,
    k31_dsa_gates,
    kda_f_b_proj_alias,
    lora_latent_expert_width,
    lora_output_gate,
    lora_params_dtype,
    lora_shared_experts_alias,
    lora_unfused_front,
    moe_lora_marlin,
    routed_experts_capture,
)
from kimi_sglang_plugin.patches.hook_patch import HOST, HookPatch, covered_releases

__all__ = [
    "HookPatch",
    "LEDGER",
    "HOST",
    "covered_releases",
    "patches_for",
    "resolve_hook",
    "check_hook_patch",
    "patch_problems",
    "rows_of",
]


def rows_of(module) -> tuple[HookPatch, ...]:
    """The ledger rows a patch file holds: its ``ENTRIES``, or its one ``ENTRY``."""
    return tuple(module.ENTRIES) if hasattr(module, "ENTRIES") else (module.ENTRY,)


#: every row of the patch files, in the order of the table above
LEDGER: tuple[HookPatch, ...] = tuple(
    row
    for module in (
        k31_dsa_gates,
        lora_shared_experts_alias,
        lora_output_gate,
        lora_latent_expert_width,
        lora_params_dtype,
        kda_f_b_proj_alias,
        moe_lora_marlin,
        attn_residual_width,
        routed_experts_capture,
        lora_unfused_front,
        hybrid_indexer_metadata,
        checksum_refusal,
    )
    for row in rows_of(module)
)


def patches_for(release: str) -> tuple[HookPatch, ...]:
    """The ledger rows whose ``versions`` contain SGLang ``release``."""
    from packaging.specifiers import SpecifierSet

    return tuple(e for e in LEDGER if release in SpecifierSet(e.versions))


def resolve_hook(entry: HookPatch):
    """Our hook function of ``entry`` (imports its module)."""
    mod, fn = entry.fn.split(":")
    return getattr(importlib.import_module(mod), fn)


def check_hook_patch(entry: HookPatch, release: str) -> None:
    """:func:`kimi_core.patch_ledger.check_patch` for SGLang ``release``, plus the target against the recorded
    facts of that release and the import of our hook function; nothing is patched.

    :raises PatchTargetError: naming the row, the target and what differs (with where the release has it).
    """
    if release not in FACTS.get(entry.target, {}):
        raise PatchTargetError(
            f"{entry.key}: target {entry.target} has no recorded facts for SGLang {release} "
            "(kimi_sglang_plugin/host_support.py)"
        )
    differs = compare(entry.target, release)
    if differs is not None:
        raise PatchTargetError(f"{entry.key}: {differs}")
    check_patch(entry, release)
    try:
        resolve_hook(entry)
    except (ImportError, AttributeError) as e:
        raise PatchTargetError(f"{entry.key}: hook {entry.fn} not importable ({e})") from e


def patch_problems(release: str, entries: tuple[HookPatch, ...] | None = None) -> list[str]:
    """The :func:`check_hook_patch` message of every row of ``entries`` (default: the ledger) that applies to
    SGLang ``release`` and does not pass; empty when all is well."""
    from packaging.specifiers import SpecifierSet

    problems = []
    for entry in LEDGER if entries is None else entries:
        if release not in SpecifierSet(entry.versions):
            continue
        try:
            check_hook_patch(entry, release)
        except PatchTargetError as e:
            problems.append(str(e))
    return problems
