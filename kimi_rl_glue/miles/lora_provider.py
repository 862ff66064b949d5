"""miles' ``--lora-provider-path kimi_rl_glue.miles.lora_provider``: Kimi LoRA in miles' raw Megatron mode.

The protocol (miles' native-LoRA branch, radixark/miles#1792; main rejects the flag). Read in
``radixark/miles:miles_plugins/lora/lora.py`` (default provider, ``wrap_model_provider_with_lora``),
``miles_plugins/lora/hf_adapter.py`` (``load_lora_adapter_hf``, ``export_lora_hf_named``) and the
resolver/saver in ``miles/backends/megatron_utils/lora_utils.py`` (``resolve_lora_provider`` imports
the module and asserts the three names exist; the saver calls ``export_lora_hf_named(model)`` and
writes the pairs into ``adapter_model.safetensors``):

* ``wrap_model_provider_with_lora(provider_func, args) -> provider``: the returned provider is
  called with Megatron's ``(pre_process, post_process, vp_stage=...)`` for every model chunk,
  before Float16Module/DDP wrapping;
* ``load_lora_adapter_hf(model_chunks, adapter_path: str) -> int``: after the base checkpoint
  load; ``adapter_path`` is a PEFT directory; returns a count (miles only logs it);
* ``export_lora_hf_named(model_chunks) -> list[(hf_name, tensor)]``: full (TP/EP-gathered) bf16
  tensors on every rank, names without ``base_model.model.`` (miles' native exporter yields
  ``model.layers.3.self_attn.q_proj.lora_A.weight``); pipeline stages are *not* gathered here,
  miles assembles them (``pp_assemble_full_adapter``).

Everything LoRA is :mod:`kimi_megatron_plugin.lora` (:func:`apply_lora`, :meth:`KimiLora.load_adapter`,
:func:`export_adapter`); this module maps miles' flags onto a :class:`~kimi_core.lora.LoraSpec` and
makes the factors part of each chunk so miles' optimizer, ``.cuda()``, Float16Module and DDP see
them. They are registered under :data:`SLOT` but hidden from ``state_dict``/``sharded_state_dict``
(the base checkpoint and our HF mapping stay unchanged; miles saves the adapter through
``export_lora_hf_named``), and a strict base ``load_state_dict`` does not miss them.

Flags read: ``--lora-rank``, ``--lora-alpha``, ``--target-modules`` (HF leaves such as
``q_a_proj,kv_b_proj,o_proj,gate_proj`` or Megatron leaves such as ``linear_proj,linear_fc1``;
``all-linear``), ``--exclude-modules``, ``--lora-dropout`` (must be 0), ``--experts-shared-outer-loras``,
``--hf-checkpoint``, ``--seed``; and ``kimi_normalize_moe_lora`` (expert rank = rank // top-k), set
with ``--custom-config-path``.
"""

from __future__ import annotations

import functools
import logging

import torch

from kimi_core.errors import KimiError
from kimi_core.lora import ALL_LINEAR, Adapter, LoraSpec
from kimi_core.lora.naming import PEFT_PREFIX, hf_leaves, target_names
from kimi_megatron_plugin.checkpoint import unwrap_model
from kimi_megatron_plugin.lora.attach import SLOT, attach_lora, lora_of

__all__ = [
    "SLOT",
    "LoraProviderError",
    "lora_spec_from_args",
    "wrap_model_provider_with_lora",
    "load_lora_adapter_hf",
    "export_lora_hf_named",
]

log = logging.getLogger(__name__)


class LoraProviderError(KimiError, ValueError):
    """A miles flag cannot be mapped onto Kimi LoRA, or a model chunk has none; names the flag."""


def lora_spec_from_args(args) -> LoraSpec:
    """The :class:`LoraSpec` of miles' LoRA flags (see the module docstring)."""
    rank = int(getattr(args, "lora_rank", 0) or 0)
    if rank <= 0:
        raise LoraProviderError(f"--lora-rank is {rank}; the Kimi LoRA provider needs --lora-rank > 0")
    if float(getattr(args, "lora_dropout", 0.0) or 0.0) != 0.0:
        raise LoraProviderError(
            f"--lora-dropout {args.lora_dropout}: kimi_megatron_plugin LoRA has no dropout; use --lora-dropout 0"
        )
    targets = target_names(getattr(args, "target_modules", None))
    if not targets:
        raise LoraProviderError(
            "--target-modules is empty; give HF leaves (q_a_proj,o_proj,gate_proj,...), "
            "Megatron leaves (linear_proj,linear_fc1,...) or all-linear"
        )
    return LoraSpec(
        rank=rank,
        alpha=float(getattr(args, "lora_alpha", 16)),
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else hf_leaves(targets),
        exclude_modules=hf_leaves(target_names(getattr(args, "exclude_modules", None))),
        expert_layout="shared_outer" if getattr(args, "experts_shared_outer_loras", False) else "per_expert",
        normalize_moe_lora=bool(getattr(args, "kimi_normalize_moe_lora", False)),
        base_model_name_or_path=getattr(args, "hf_checkpoint", None) or "",
    )


def _attach(model, spec: LoraSpec, seed: int, hf_checkpoint: str | None):
    inner = unwrap_model(model)
    if getattr(inner, "kimi_config", None) is None:
        if not hf_checkpoint:
            raise LoraProviderError("--hf-checkpoint is required: its config.json describes the Kimi LoRA targets")
        from kimi_core.config import load_config

        inner.kimi_config = load_config(hf_checkpoint)
    attach_lora(inner, spec, seed=seed)
    return model


def wrap_model_provider_with_lora(provider_func, args):
    """miles' provider wrapper: every chunk ``provider_func`` builds gets Kimi LoRA (base frozen).

    The spec is checked now, so a bad flag fails before any model is built.
    """
    spec = lora_spec_from_args(args)
    seed = int(getattr(args, "seed", 0) or 0)
    hf = getattr(args, "hf_checkpoint", None)

    @functools.wraps(provider_func)  # Megatron inspects the provider's signature
    def provider(*provider_args, **provider_kwargs):
        return _attach(provider_func(*provider_args, **provider_kwargs), spec, seed, hf)

    return provider


def _chunks(model_chunks) -> list:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def _lora_of(chunk):
    lora = lora_of(chunk)
    if lora is None:
        raise LoraProviderError(
            "model chunk has no Kimi LoRA: build it through wrap_model_provider_with_lora "
            "(--lora-provider-path kimi_rl_glue.miles.lora_provider with --lora-rank > 0)"
        )
    return lora


def load_lora_adapter_hf(model_chunks, adapter_path: str) -> int:
    """Set every chunk's factors from the PEFT directory ``adapter_path`` (any Kimi layout, names with
    or without ``base_model.model.``); validation errors name the file and tensor.

    :returns: the number of LoRA parameter tensors set on this rank.
    """
    adapter = Adapter.load(adapter_path)
    n = 0
    for chunk in _chunks(model_chunks):
        lora = _lora_of(chunk)
        lora.load_adapter(adapter)
        n += sum(1 for _ in lora.parameters())
    return n


def export_lora_hf_named(model_chunks) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, bf16 tensor)`` of every adapter tensor of these chunks (collective over TP and EP).

    Names are HF/PEFT module names without ``base_model.model.`` (``model.layers.1.mlp.experts.0.
    gate_proj.lora_A.weight``); experts in the per-expert layout, or ``shared_outer`` with
    ``--experts-shared-outer-loras``.
    """
    from kimi_megatron_plugin.lora import export_adapter

    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for chunk in _chunks(model_chunks):
        lora = _lora_of(chunk)
        ad = export_adapter(lora, layout=lora.spec.expert_layout, dtype=torch.bfloat16, gather_pipeline=False)
        for name, t in ad.tensors.items():
            name = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
            if name not in seen:
                seen.add(name)
                out.append((name, t.contiguous()))
    return out
