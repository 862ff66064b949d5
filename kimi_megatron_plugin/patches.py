"""Ledger of every patch this plugin applies to megatron-core (or to torch on megatron's behalf).

The patches themselves live in :mod:`kimi_megatron_plugin.cpu_compat`; each is checked against its
entry here (:func:`kimi_core.patch_ledger.check_patch`) right before it is applied, so a megatron-core
or torch release that moves or changes a target fails at startup with the entry's name.

``cpu_current_device`` (every process without CUDA, at :func:`~kimi_megatron_plugin.cpu_compat.apply_cpu_shims`)
    Target: ``torch.cuda.current_device`` (replaced process-wide by a function returning ``"cpu"``).
    Why: megatron-core allocates router buffers and rotary tables on ``torch.cuda.current_device()``.
    How: return ``"cpu"`` so each ``.to(device=...)`` is a no-op; undone by ``remove_cpu_shims``.
    Remove when: megatron-core takes the device from the config (NVIDIA/Megatron-LM#6270).

``mla_have_te`` (every process, at import of :mod:`kimi_megatron_plugin.layers`)
    Target: ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` (set to False without TE).
    Why: without TransformerEngine the module still sets it True (TE's import defines mocks), and MLA's
    constructor then calls ``isinstance`` with a mock.
    Remove when: megatron-core checks for real TE classes.

``router_te_general_gemm`` (every process, at import of :mod:`kimi_megatron_plugin.layers`)
    Target: ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` (bound to None when absent),
    read by ``RouterGatingLinearFunction.forward``.
    Why: the name is bound only when TE imports, so the router raises ``NameError`` without TE.
    Remove when: megatron-core binds the name on every import path.
"""

from __future__ import annotations

from kimi_core.patch_ledger import PatchEntry, check_patch

__all__ = ["LEDGER", "check"]

_MCORE = ">=0.16.1,<0.20"  # the releases kimi_megatron_plugin.version accepts, 0.16.1 and 0.19.x run
_PR_6270 = "NVIDIA/Megatron-LM#6270 (avoid MCore CUDA assumptions in CPU-only model conversion)"

LEDGER: dict[str, PatchEntry] = {e.name: e for e in (
    PatchEntry(
        name="cpu_current_device", target="torch.cuda.current_device", host="megatron-core", releases=_MCORE,
        why="TopKRouter and (YaRN) RotaryEmbedding allocate on torch.cuda.current_device(); no CUDA on CPU CI",
        how="replace torch.cuda.current_device by a function returning 'cpu' (only when CUDA is absent)",
        upstream=_PR_6270, remove_when="megatron-core takes the device from the config on CPU",
        expect="signature:() -> int"),
    PatchEntry(
        name="mla_have_te", target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
        host="megatron-core", releases=_MCORE,
        why="HAVE_TE is True without TE (mock classes), so MLA's isinstance(linear_proj, TELinear) raises",
        how="set HAVE_TE = False when TELinear is not a class", upstream=_PR_6270,
        remove_when="megatron-core sets HAVE_TE from a real TE import", expect="type:bool"),
    PatchEntry(
        name="router_te_general_gemm",
        target="megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward",
        host="megatron-core", releases=_MCORE,
        why="forward tests te_general_gemm, a name bound only when TE imports: NameError without TE",
        how="bind moe_utils.te_general_gemm = None when absent (megatron takes its torch matmul path)",
        upstream=_PR_6270, remove_when="megatron-core binds te_general_gemm without TE",
        expect="reads:te_general_gemm"),
)}


def check(name: str, *, target_obj=None) -> None:
    """Check ledger entry ``name`` against the installed megatron-core (see :func:`check_patch`)."""
    from kimi_megatron_plugin.version import mcore_version

    check_patch(LEDGER[name], str(mcore_version()), target_obj=target_obj)
