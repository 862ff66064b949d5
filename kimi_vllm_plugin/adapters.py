"""An adapter as vLLM serves it: every expert layout rewritten to per-expert 2-D, per-module scaling folded.

vLLM reads routed-expert LoRA in the numbered per-expert 2-D form (``...experts.{e}.<proj>.lora_A.weight``,
``is_3d_moe_weight=False``, packed through ``packed_modules_mapping["experts"]``), and vLLM 0.26's
``PEFTHelper`` has no ``rank_pattern`` / ``alpha_pattern``: it scales every module by ``lora_alpha / r``, so a
capacity-normalised adapter (experts at rank ``r // top_k``, their scaling through the patterns) would be served
with its experts ``top_k`` times too weak and no error (0.32+ reads the patterns).

:func:`prepare_adapter` returns the form every supported release serves as the PEFT adapter means it: validated
with :mod:`kimi_core.lora` (missing file, unknown module, wrong shape, NaN/Inf, rank above ``max_lora_rank``,
rank disagreeing with ``r`` / ``rank_pattern``), expert factors rewritten from any layout (per-expert,
shared-outer, 3-D, stacked) to per-expert 2-D, bit-exact, and each module's scaling folded into its ``lora_B``
(:func:`kimi_core.lora.fold_scaling.fold_pattern_scaling`). A module vLLM cannot give LoRA
(:data:`UNSERVED_LORA_MODULES`) is refused with its tensor name, never silently dropped. The SGLang plugin's
:func:`kimi_sglang_plugin.adapters.prepare_adapter` has the same signature and contract for SGLang.
"""

from __future__ import annotations

import os

from kimi_core.errors import AdapterRejected

__all__ = ["UNSERVED_LORA_MODULES", "prepare_adapter"]

#: module leaves whose LoRA vLLM's MLA cannot apply: ``kv_b_proj`` is absorbed into the attention kernel's
#: W_UK / W_UV at load (the CPU AMX MLA never calls it), so a delta there would be silently dropped in decode
UNSERVED_LORA_MODULES = ("kv_b_proj",)


def prepare_adapter(adapter, config, *, max_lora_rank: int | None = None, out_dir: str | os.PathLike | None = None):
    """The vLLM-served form of ``adapter`` for model ``config``; see the module docstring.

    :param adapter: a PEFT folder (HF/PEFT names), a :class:`kimi_core.lora.Adapter`, or
        ``{"adapter_config": dict, "tensors": {name: tensor}}``.
    :param config: the model's :class:`kimi_core.config.KimiConfig`.
    :param max_lora_rank: the engine's ``--max-lora-rank``; a module of higher rank is refused (None: no bound).
    :param out_dir: when given, the result is also written there as a PEFT folder, atomically (a new folder
        swapped in, :meth:`kimi_core.lora.Adapter.save_replacing`), and its ``source`` names that folder.
    :returns: a new :class:`kimi_core.lora.Adapter`; the input is not modified.
    :raises AdapterRejected: naming the folder or file, the tensor and what was expected.
    """
    from kimi_core.lora import Adapter, AdapterError, convert_layout, load_adapter
    from kimi_core.lora.config import AdapterConfigError
    from kimi_core.lora.fold_scaling import fold_pattern_scaling

    where = os.fspath(adapter) if isinstance(adapter, (str, os.PathLike)) else getattr(adapter, "source", "<memory>")
    try:
        ad = Adapter.load(adapter) if isinstance(adapter, (str, os.PathLike)) else adapter
        if not isinstance(ad, Adapter):
            ad = Adapter(dict(ad["tensors"]), ad["adapter_config"], ad.get("source", "<memory>"))
        resolved = load_adapter(ad, config, max_rank=max_lora_rank)
        _refuse_unserved(ad, where)
        if resolved.layout not in (None, "per_expert"):
            ad = convert_layout(ad, config, "per_expert")
        ad = fold_pattern_scaling(ad)
    except (AdapterError, AdapterConfigError, FileNotFoundError) as e:
        raise AdapterRejected(str(e)) from None
    if out_dir is not None:
        ad.source = ad.save_replacing(out_dir)
    return ad


def _refuse_unserved(adapter, where: str) -> None:
    """Raise :class:`AdapterRejected` naming the first tensor of a module in :data:`UNSERVED_LORA_MODULES`."""
    for name in adapter.tensors:
        leaf = name.split(".lora_", 1)[0].rsplit(".", 1)[-1]
        if ".lora_" in name and leaf in UNSERVED_LORA_MODULES:
            raise AdapterRejected(
                f"{where}: {name}: vLLM serves no LoRA on {leaf} (its MLA absorbs {leaf} into the attention kernel "
                f"at load, so the delta would be dropped); expected an adapter without it: train with "
                f"exclude_modules=['{leaf}']"
            )
