"""Every monkey-patch the plugin applies to vLLM: one file per patch, each with its ledger row ``ENTRY``.

:data:`LEDGER` collects the rows (:class:`kimi_core.patch_ledger.PatchEntry`: target, host releases, why, how,
upstream, removal condition, what the target must look like). The row is the one description of a patch;
the file beside it holds only the code. Every patch is idempotent or scoped to one construction, and checks
its target before it is applied: :func:`kimi_core.patch_ledger.check_patch` against the row (``lora_layers``,
``cpu_punica_no_lora``, ``lora_dir_prepare``, ``lora_reload_cache``), or a missing-target check raising
:class:`~kimi_core.errors.PatchTargetError` with the row's name (the construction-time swaps).

=====================  ======================================  =====================================================
patch (file)           when                                    what
=====================  ======================================  =====================================================
``lora_layers``        worker, CPU, before model construction  our CPU experts' LoRA wrapper in vLLM's LoRA table
``cpu_punica_no_lora`` worker, CPU, before model construction  tokens without an adapter get no LoRA delta
``moe_block``          worker, CPU, during K2.x construction   DeepSeek decoder layers build our CPU MoE block
``k3_cpu_build``       worker, CPU, during K3 construction     the in-tree K3 builds our CPU MoE block
``k25_text_model``     worker, during K2.5 construction        K2.5's text model is our LoRA-capable K2.x class
``k31_config``         every process, at ``register()``        ``model_type: kimi_k31`` parses as K3's config
``lora_dir_prepare``   worker, any device, at Kimi construction a LoRA folder vLLM loads is prepared by the plugin
``lora_reload_cache``  engine core, at ``register()`` or its   an adapter reloaded under a name served before
                       import (Kimi engines only)              resets the prefix cache
=====================  ======================================  =====================================================
"""

import logging

from kimi_core.patch_ledger import PatchEntry, check_patch
from kimi_vllm_plugin.patches import (
    cpu_punica_no_lora,
    k3_cpu_build,
    k25_text_model,
    k31_config,
    lora_dir_prepare,
    lora_layers,
    lora_reload_cache,
    moe_block,
)

__all__ = ["LEDGER", "build_upstream"]

#: ledger name -> row, in the order of the table above
LEDGER: dict[str, PatchEntry] = {
    m.ENTRY.name: m.ENTRY
    for m in (
        lora_layers,
        cpu_punica_no_lora,
        moe_block,
        k3_cpu_build,
        k25_text_model,
        k31_config,
        lora_dir_prepare,
        lora_reload_cache,
    )
}


def build_upstream(model, parent_init, cpu_swap, **kwargs) -> None:
    """Run the upstream ``__init__`` (``parent_init(**kwargs)``) of one of our LoRA classes.

    ``model`` gets its own copy of its class's ``packed_modules_mapping`` first (the upstream ``__init__``
    adds entries to it), ``model._cpu_moe`` and its checkpoint path, and the ``lora_dir_prepare`` patch is
    installed (on every device: any LoRA folder vLLM loads for it is prepared by the plugin). On a CPU host the ``lora_layers`` and ``cpu_punica_no_lora``
    patches are checked and applied, and ``cpu_swap()`` (a zero-argument callable returning the
    ``moe_block`` or ``k3_cpu_build`` context manager, so the CPU MoE module is imported only there) is
    held while the upstream ``__init__`` runs.

    :raises kimi_core.errors.PatchTargetError: a patched vLLM symbol is not what its ledger row recorded.
    """
    from vllm.platforms import current_platform

    model.packed_modules_mapping = {k: list(v) for k, v in type(model).packed_modules_mapping.items()}
    model._cpu_moe = current_platform.is_cpu()
    logging.getLogger("kimi_vllm_plugin").info(
        "kimi_vllm_plugin: building %s (%s MoE)", type(model).__name__, "CPU" if model._cpu_moe else "vLLM's fused"
    )
    lora_dir_prepare.mark_model(model, kwargs["vllm_config"])
    lora_dir_prepare.install()
    if not model._cpu_moe:
        parent_init(**kwargs)
        return
    for patch in (lora_layers, cpu_punica_no_lora):
        check_patch(patch.ENTRY)
        patch.apply()
    with cpu_swap():
        parent_init(**kwargs)
