"""Shims around megatron-core's CUDA assumptions, for CPU-only runs (CI, the CPU demo).

Applied by :func:`apply_cpu_shims` only when ``torch.cuda.is_available()`` is False; on a GPU it
does nothing. Each shim names the upstream assumption it works around (megatron-core 0.16.1 and
0.19.2; see ``shared/reference/megatron.md`` section 3); each is a ledger entry in
:mod:`kimi_megatron_plugin.patches`, checked right before it is applied. The related upstream work is
NVIDIA/Megatron-LM PR #6270 ("avoid MCore CUDA assumptions in CPU-only model conversion");
remove a shim when the installed megatron-core no longer makes the assumption.

Shims that are *not* needed because the plugin avoids the code path:

* ``get_default_causal_mask`` (``device="cuda"``): :class:`~kimi_megatron_plugin.layers.KimiCoreAttention`
  builds its own causal mask.
* the alltoall dispatcher's ``torch.cuda.Stream()``: the plugin uses the allgather dispatcher.
* local ``DotProductAttention`` rejecting ``k_channels``: the plugin has its own MLA core attention.
* ``model_parallel_cuda_manual_seed``: not called; weights come from the checkpoint.
"""

from __future__ import annotations

import os

import torch

__all__ = ["apply_no_te_shims", "apply_cpu_shims", "cpu_shims_active", "initialize_cpu_parallel", "destroy_cpu_parallel"]

_ACTIVE = False
_ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device


def _cpu_current_device():
    return "cpu"


def apply_no_te_shims() -> bool:
    """Fix megatron-core's "is TransformerEngine there?" flag in MLA when TE is absent (CPU or GPU).

    Upstream assumption (0.16.1): importing ``megatron.core.extensions.transformer_engine``
    succeeds without TE (it defines ``MagicMock`` placeholders), so ``multi_latent_attention``
    sets ``HAVE_TE = True`` and ``MultiLatentAttention.__init__`` then evaluates
    ``isinstance(self.linear_proj, TELinear)`` with a mock, which raises
    ``TypeError: isinstance() arg 2 must be a type, a tuple of types, or a union``.
    The shim sets that module's ``HAVE_TE`` to False when ``TELinear`` is not a class.

    Second assumption (0.16.1): ``moe_utils.RouterGatingLinearFunction.forward`` tests
    ``te_general_gemm is not None``, but the name is only bound when TE imports, so without TE
    the router raises ``NameError: name 'te_general_gemm' is not defined``. The shim binds it to
    None (megatron then takes its torch matmul path).

    Returns True when it changed something. Remove both when upstream guards these names.
    """
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    from kimi_megatron_plugin import patches

    patches.check("mla_have_te")
    patches.check("router_te_general_gemm")
    changed = False
    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
        changed = True
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        changed = True
    return changed


def cpu_shims_active() -> bool:
    return _ACTIVE


def apply_cpu_shims() -> bool:
    """Install the shims if no GPU is present (idempotent). Returns True when they are active.

    1. ``torch.cuda.current_device`` returns ``"cpu"``. Upstream assumption: a CUDA device always
       exists. ``TopKRouter.__init__`` allocates ``expert_bias``/``local_tokens_per_expert`` on it,
       ``TopKRouter.gating`` moves CPU weights to it, ``RotaryEmbedding``/``YarnRotaryEmbedding``
       (which ``MLASelfAttention`` builds without ``use_cpu_initialization``) allocate and move
       ``inv_freq`` to it. Returning ``"cpu"`` turns every such ``.to(device=...)`` into a no-op.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if not _ACTIVE:
        from kimi_megatron_plugin import patches

        patches.check("cpu_current_device", target_obj=_ORIGINAL_CURRENT_DEVICE)
        torch.cuda.current_device = _cpu_current_device
        _ACTIVE = True
    return True


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims` (tests)."""
    global _ACTIVE
    torch.cuda.current_device = _ORIGINAL_CURRENT_DEVICE
    _ACTIVE = False


def initialize_cpu_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                            rank: int | None = None, world_size: int | None = None, port: int | None = None) -> None:
    """gloo process group + megatron's model-parallel groups on CPU, with the shims applied.

    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment (torchrun) or 0/1.
    """
    apply_cpu_shims()
    from megatron.core import parallel_state

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port or 29571))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=1)


def destroy_cpu_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
