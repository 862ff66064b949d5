"""Patch ``router_te_general_gemm``: bind ``moe_utils.te_general_gemm`` when TransformerEngine is absent.

``moe_utils.RouterGatingLinearFunction.forward`` tests ``te_general_gemm is not None``, but the module
binds that name only when TE imports, so without TE the router raises ``NameError: name
'te_general_gemm' is not defined``. The patch binds it to None, and megatron takes its torch matmul path.

Ledger row: ``router_te_general_gemm`` in :mod:`kimi_megatron_plugin.patches`.
"""

from __future__ import annotations

__all__ = ["apply"]


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
