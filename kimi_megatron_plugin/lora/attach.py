"""Kimi LoRA as part of a host's model chunk: trainable, wrapped and optimised with it, invisible to checkpoints.

:func:`~kimi_megatron_plugin.lora.apply.apply_lora` keeps the factors beside the model (a plain attribute), which
suits our own trainer. A host loop (miles' raw Megatron mode, SkyRL's Megatron worker) builds its optimizer, its
``Float16Module`` / DDP wrapping and ``.cuda()`` from the chunk's parameters, so :func:`attach_lora` registers the
factors as a child module :data:`SLOT` whose ``state_dict`` / ``sharded_state_dict`` are empty: the base
checkpoint, Megatron-Bridge's HF mapping and a strict ``load_state_dict`` see the model they expect, and the
adapter is saved through :func:`~kimi_megatron_plugin.lora.export.export_adapter` instead.

Gradient reduction in Megatron's DDP follows the parameter's ``allreduce`` attribute, as for Megatron's own expert
weights: per-expert factors (each EP rank holds its experts' own) get ``allreduce = False`` and are reduced over the
expert-data-parallel group; every other factor (dense, and the shared-outer expert factors) is reduced over the
data-parallel group. A shared-outer factor is also replicated over the EP group and needs its gradient summed there
(:meth:`~kimi_megatron_plugin.lora.apply.KimiLora.finalize_grads`), which Megatron's DDP does not do:
:func:`needs_ep_reduction` says when a host must add it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from kimi_core.lora import LoraSpec
from kimi_megatron_plugin.checkpoint import unwrap_model
from kimi_megatron_plugin.lora.apply import KimiLora, LoraApplyError, apply_lora

__all__ = ["SLOT", "attach_lora", "lora_of", "needs_ep_reduction"]

log = logging.getLogger(__name__)

#: child-module name under which each chunk holds its LoRA factors
SLOT = "kimi_lora_params"


class _Slot(torch.nn.Module):
    """Holds a chunk's :class:`KimiLora` as a child (parameters visible, state dict hidden)."""

    def __init__(self, lora: KimiLora):
        super().__init__()
        self.lora = lora

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        return destination if destination is not None else OrderedDict()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _ignore_slot_keys(_module, incompatible) -> None:
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if f".{SLOT}." not in f".{k}"]


def attach_lora(model, spec: LoraSpec, seed: int = 0) -> KimiLora:
    """Give one model chunk (a ``GPTModel`` built by this plugin, possibly wrapped) Kimi LoRA; base frozen.

    :returns: the chunk's :class:`KimiLora` (also ``unwrap(model).kimi_lora``).
    :raises LoraApplyError: the chunk was not built by this plugin (no ``kimi_config``).
    """
    inner = unwrap_model(model)
    if getattr(inner, "kimi_config", None) is None:
        raise LoraApplyError(
            f"{type(inner).__name__} has no kimi_config: Kimi LoRA attaches to models built by kimi_megatron_plugin"
        )
    lora = apply_lora(inner, spec, seed=seed)
    if not len(lora.dense) and not len(lora.experts):  # legal on a pipeline stage without targets
        log.warning("kimi LoRA: target_modules %s select no module of this model chunk", spec.target_modules)
    for experts in lora.experts.values():
        shared = {id(p) for p in experts.shared_parameters()}
        for p in experts.parameters():
            if id(p) not in shared:
                p.allreduce = False  # Megatron DDP: an expert-parallel parameter (reduced over expert-DP)
    del inner.__dict__["kimi_lora"]  # apply_lora's plain attribute; the slot makes it a real child
    inner.add_module(SLOT, _Slot(lora))
    object.__setattr__(inner, "kimi_lora", lora)
    inner.register_load_state_dict_post_hook(_ignore_slot_keys)
    return lora


def lora_of(chunk) -> KimiLora | None:
    """The :class:`KimiLora` of a (wrapped) chunk, or ``None``."""
    return getattr(unwrap_model(chunk), "kimi_lora", None)


def needs_ep_reduction(lora: KimiLora) -> bool:
    """Whether ``lora`` has expert factors replicated over an EP group larger than one (shared-outer layout under
    expert parallelism), whose gradients Megatron's DDP does not sum over EP."""
    return lora.par["ep"] > 1 and any(m.shared_parameters() for m in lora.experts.values())
