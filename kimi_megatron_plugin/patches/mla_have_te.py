"""Patch ``mla_have_te``: megatron-core's MLA believes TransformerEngine is installed when it is not.

Importing ``megatron.core.extensions.transformer_engine`` succeeds without TE (it defines ``MagicMock``
placeholders), so ``multi_latent_attention`` sets ``HAVE_TE = True`` and ``MultiLatentAttention.__init__``
then evaluates ``isinstance(self.linear_proj, TELinear)`` with a mock: ``TypeError: isinstance() arg 2
must be a type, a tuple of types, or a union``. The patch sets that module's ``HAVE_TE`` to False when
``TELinear`` is not a class; with TE installed nothing changes.

Ledger row: :data:`ENTRY`, collected in :mod:`kimi_megatron_plugin.patches`.
"""

from __future__ import annotations

from kimi_core.patch_ledger import PatchEntry
from kimi_megatron_plugin.host_support import MEGATRON_CORE

__all__ = ["ENTRY", "apply"]

#: this patch's ledger row
ENTRY = PatchEntry(
    name="mla_have_te",
    target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
    host=MEGATRON_CORE.distribution,
    versions=MEGATRON_CORE.ledger_releases,
    why="HAVE_TE is True without TE (mock classes), so MLA's isinstance(linear_proj, TELinear) raises",
    how="set HAVE_TE = False when TELinear is not a class",
    upstream="NVIDIA/Megatron-LM#6270 (avoid MCore CUDA assumptions in CPU-only model conversion)",
    remove_when="megatron-core sets HAVE_TE from a real TE import",
    expect="type:bool",
)


def apply() -> bool:
    """Apply the patch (idempotent; CPU or GPU); returns True when it changed the flag.

    :raises kimi_core.errors.PatchTargetError: the flag is gone or no longer a bool.
    """
    from megatron.core.transformer import multi_latent_attention as mla

    from kimi_megatron_plugin import patches

    patches.check("mla_have_te")
    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
        return True
    return False
