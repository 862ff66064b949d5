"""Patch ``router_te_general_gemm``: bind ``moe_utils.te_general_gemm`` when TransformerEngine is absent.

``moe_utils.RouterGatingLinearFunction.forward`` tests ``te_general_gemm is not None``, but the module
binds that name only when TE imports, so without TE the router raises ``NameError: name
'te_general_gemm' is not defined``. The patch binds it to None, and megatron takes its torch matmul path.

Ledger row: :data:`ENTRY`, collected in :mod:`kimi_megatron_plugin.patches`.
"""

from __future__ import annotations

from kimi_core.patch_ledger import PatchEntry
from kimi_megatron_plugin.host_support import MEGATRON_CORE

__all__ = ["ENTRY", "apply"]

#: this patch's ledger row
ENTRY = PatchEntry(
    name="router_te_general_gemm",
    target="megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward",
    host=MEGATRON_CORE.distribution,
    versions=MEGATRON_CORE.ledger_releases,
    why="forward tests te_general_gemm, a name bound only when TE imports: NameError without TE",
    how="bind moe_utils.te_general_gemm = None when absent (megatron takes its torch matmul path)",
    upstream="NVIDIA/Megatron-LM#6270 (avoid MCore CUDA assumptions in CPU-only model conversion)",
    remove_when="megatron-core binds te_general_gemm without TE",
    expect="reads:te_general_gemm",
)


def apply() -> bool:
    """Apply the patch (idempotent; CPU or GPU); returns True when it bound the name.

    :raises kimi_core.errors.PatchTargetError: the router's forward no longer reads ``te_general_gemm``.
    """
    from megatron.core.transformer.moe import moe_utils

    from kimi_megatron_plugin import patches

    patches.check("router_te_general_gemm")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        return True
    return False
