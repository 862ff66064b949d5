"""Patch ``cpu_current_device``: ``torch.cuda.current_device`` returns ``"cpu"`` in processes without CUDA.

megatron-core assumes a CUDA device exists: ``TopKRouter.__init__`` allocates ``expert_bias`` /
``local_tokens_per_expert`` on ``torch.cuda.current_device()``, ``TopKRouter.gating`` moves CPU weights
there, and ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` (built by ``MLASelfAttention`` without
``use_cpu_initialization``) allocate and move ``inv_freq`` there. Returning ``"cpu"`` turns every such
``.to(device=...)`` into a no-op. On a machine with CUDA nothing is changed.

CUDA assumptions the plugin avoids instead of patching:

* ``get_default_causal_mask`` (``device="cuda"``): :class:`~kimi_megatron_plugin.models.layers.KimiCoreAttention`
  builds its own causal mask;
* the alltoall dispatcher's ``torch.cuda.Stream()``: the plugin uses the allgather dispatcher;
* ``model_parallel_cuda_manual_seed``: not called; weights come from the checkpoint.

Ledger row: :data:`ENTRY`, collected in :mod:`kimi_megatron_plugin.patches`.
"""

from __future__ import annotations

import torch

from kimi_core.patch_ledger import PatchEntry
from kimi_megatron_plugin.host_support import MEGATRON_CORE

__all__ = ["ENTRY", "apply", "remove", "active", "ORIGINAL"]

#: this patch's ledger row
ENTRY = PatchEntry(
    name="cpu_current_device",
    target="torch.cuda.current_device",
    host=MEGATRON_CORE.distribution,
    versions=MEGATRON_CORE.ledger_releases,
    why="TopKRouter and (YaRN) RotaryEmbedding allocate on torch.cuda.current_device(); a CPU has no CUDA",
    how="replace torch.cuda.current_device by a function returning 'cpu', only when CUDA is absent; "
    "cpu_current_device.remove() undoes it",
    upstream="NVIDIA/Megatron-LM#6270 (avoid MCore CUDA assumptions in CPU-only model conversion)",
    remove_when="megatron-core takes the device from the config on CPU",
    expect="signature:() -> int",
)

#: the function the patch replaces, kept to undo it and to check the ledger row against
ORIGINAL = torch.cuda.current_device
_ACTIVE = False


def _cpu_current_device():
    return "cpu"


def active() -> bool:
    """Whether :func:`apply` has replaced ``torch.cuda.current_device`` in this process."""
    return _ACTIVE


def apply() -> bool:
    """Install the patch when no GPU is present (idempotent); returns True when it is active.

    :raises kimi_core.errors.PatchTargetError: ``torch.cuda.current_device`` no longer looks as the ledger row says.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if not _ACTIVE:
        from kimi_megatron_plugin import patches

        patches.check("cpu_current_device", target_obj=ORIGINAL)
        torch.cuda.current_device = _cpu_current_device
        _ACTIVE = True
    return True


def remove() -> None:
    """Undo :func:`apply` (tests)."""
    global _ACTIVE
    torch.cuda.current_device = ORIGINAL
    _ACTIVE = False
