"""Export the trained LoRA in HF/PEFT form, whole or streamed as checked buckets.

:func:`export_adapter` gathers this rank's factors (TP pieces, EP experts, optionally every PP
stage) into a :class:`kimi_core.lora.Adapter` in any file layout of :mod:`kimi_core.lora.layouts`:

* ``per_expert``: ``experts.{e}.<proj>`` 2-D (vLLM's 2-D MoE LoRA, PEFT on the HF model, SGLang);
* ``per_expert_3d`` / ``shared_outer``: ``experts.<proj>`` 3-D (SGLang; ``shared_outer`` =
  ``--experts-shared-outer-loras``, detected from ``shape[0] == 1``);
* ``stacked``: ``experts.base_layer`` / ``experts`` (vLLM's PEFT ``target_parameters`` form).

``adapter_config`` comes from :meth:`LoraSpec.to_adapter_config` (``r``, ``lora_alpha``,
``target_modules``, ``rank_pattern``/``alpha_pattern`` for normalised experts,
``base_model_name_or_path``). :func:`iter_export_buckets` validates the adapter against the
model config and the engine's ``max_rank`` (:func:`kimi_core.lora.load_adapter`'s checks) *before* the
first bucket is yielded, then streams :func:`kimi_core.sync.buckets.iter_buckets` (64-bit checksum per
tensor, BLAKE2b per bucket, optional expert-row filtering for a consumer rank).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kimi_core.lora import Adapter, AdapterError
from kimi_core.lora.config import AdapterConfigError, validate_adapter_config
from kimi_core.lora.layouts import Decomposed, compose, decompose
from kimi_core.sync.buckets import Bucket, iter_buckets

__all__ = ["lora_decomposed", "export_adapter", "iter_export_buckets"]


def lora_decomposed(
    lora, dtype: torch.dtype = torch.bfloat16, gather_pipeline: bool = True, grads: bool = False
) -> Decomposed:
    """Full factors of every target (collective over TP and EP; over PP with ``gather_pipeline``).

    ``grads=True`` gives their gradients in the same form (tests, gradient checks)."""
    cfg, spec = lora.config, lora.spec
    dec = Decomposed(expert_range=(0, cfg.n_routed_experts))
    r_e = spec.expert_rank(cfg.num_experts_per_tok)
    for lin in lora.dense.values():
        A, B = lin.full(grads)
        dec.dense[lin.module] = (A.to(dtype).cpu(), B.to(dtype).cpu())
        dec.rank_alpha[lin.module] = (spec.rank, float(spec.alpha))
    for m in lora.experts.values():
        for p in m.targeted:
            A, B = m.full(p, lora.par["ep_group"], grads)
            key = (m.moe, m.hf_proj[p])
            dec.experts[key] = (A.to(dtype).cpu(), B.to(dtype).cpu())
            dec.rank_alpha[key] = (r_e, spec.expert_alpha_value())
    if gather_pipeline:
        from megatron.core import parallel_state as ps

        if (
            torch.distributed.is_initialized()
            and ps.model_parallel_is_initialized()
            and ps.get_pipeline_model_parallel_world_size() > 1
        ):
            parts = [None] * ps.get_pipeline_model_parallel_world_size()
            torch.distributed.all_gather_object(
                parts, (dec.dense, dec.experts, dec.rank_alpha), group=ps.get_pipeline_model_parallel_group()
            )
            for d, e, ra in parts:
                dec.dense.update(d)
                dec.experts.update(e)
                dec.rank_alpha.update(ra)
    return dec


def export_adapter(
    lora, layout: str = "per_expert", dtype: torch.dtype = torch.bfloat16, gather_pipeline: bool = True
) -> Adapter:
    """The adapter as a :class:`kimi_core.lora.Adapter` in file ``layout`` (every rank gets it).

    ``shared_outer`` needs a spec trained with ``expert_layout="shared_outer"`` (or factors equal
    across experts); every other layout accepts both training layouts.
    """
    dec = lora_decomposed(lora, dtype, gather_pipeline)
    base = lora.spec.to_adapter_config(lora.config, layout)
    ad = compose(dec, lora.config, layout, base)
    ad.source = f"<kimi_megatron_plugin LoRA, {layout}>"
    return ad


def iter_export_buckets(
    adapter_or_lora,
    bucket_bytes: int = 256 << 20,
    *,
    config=None,
    layout: str = "per_expert",
    max_rank: int | None = None,
    experts: tuple[int, int] | None = None,
    staging: torch.Tensor | None = None,
) -> Iterator[Bucket]:
    """Validate, then stream the adapter as checksummed buckets.

    :param adapter_or_lora: an :class:`Adapter` or a :class:`~kimi_megatron_plugin.lora.apply.KimiLora`
        (exported in ``layout`` first).
    :param max_rank: the engine's ``max_lora_rank``; a larger module rank is rejected before any bucket.
    :param experts: ``(lo, hi)``: only those experts' rows (a consumer EP rank).
    :raises kimi_core.lora.AdapterError: unknown module, NaN/Inf, rank above ``max_rank``, bad shape
        (naming the tensor), before anything is yielded.
    """
    if isinstance(adapter_or_lora, Adapter):
        ad = adapter_or_lora
        if config is None:
            raise ValueError("iter_export_buckets: an Adapter needs config= (the KimiConfig it applies to)")
    else:
        ad = export_adapter(adapter_or_lora, layout=layout)
        config = adapter_or_lora.config
    # eager (not inside a generator): raises before anything is sent. ``decompose`` is load_adapter's
    # validation (names, shapes, ranks vs max_rank and rank_pattern, NaN/Inf) without its fp32 copies.
    try:
        validate_adapter_config(ad.adapter_config, ad.source)
    except AdapterConfigError as e:
        raise AdapterError(str(e)) from None
    decompose(ad.tensors, config, ad.adapter_config, where=ad.source, max_rank=max_rank)
    return iter_buckets(ad.tensors, bucket_bytes, config=config, experts=experts, staging=staging)
