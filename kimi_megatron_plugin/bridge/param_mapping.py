"""Megatron-Bridge's ``MegatronMappingRegistry`` built from this plugin's one name table (:mod:`.mapping`).

No second table: every :class:`~kimi_megatron_plugin.mapping.Rule` is expanded into Bridge
wildcard mappings (``decoder.layers.*.`` <-> ``{lm}model.layers.*.``; Bridge's ``*`` is the
global layer number, which is also the HF layer index) and its ``split`` picks the Bridge
mapping class that shards the same way :func:`kimi_megatron_plugin.checkpoint.load_hf_checkpoint` does:

=========  ============================================================================
``rep``    ``ReplicatedMapping``
``col``    ``ColumnParallelMapping`` (``hook="a_log"``: :class:`KimiHookedColumnMapping`)
``row``    ``RowParallelMapping``
``glu``    ``GatedMLPMapping`` (``[gate_shard; up_shard]``, as our ``glu``)
``expert`` :class:`KimiExpertStackMapping`: the local experts' HF tensors stacked on dim 0
           (packed bytes for ``w4a16``; ``qat``/``dense`` masters are dequantized by the
           bridge's ``maybe_modify_loaded_hf_weight``)
=========  ============================================================================

Requires megatron-bridge (import it through :func:`kimi_megatron_plugin.bridge.import_bridge`).
"""

from __future__ import annotations

import itertools
import re

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import (
    ColumnParallelMapping,
    GatedMLPMapping,
    MegatronParamMapping,
    ReplicatedMapping,
    RowParallelMapping,
)

from kimi_core.quant.formats import WEIGHT_FORMATS, weight_format
from kimi_megatron_plugin import mapping

__all__ = ["expand_rule", "build_mapping_registry", "KimiExpertStackMapping", "KimiHookedColumnMapping"]

_GROUP = re.compile(r"\(([^()]*)\)")


def expand_rule(rule: mapping.Rule) -> list[tuple[str, tuple[str, ...]]]:
    """The concrete ``(megatron name, HF templates)`` pairs of one rule's regex alternations.

    ``layer\\.(q|k)_proj\\.weight`` -> ``[("layer.q_proj.weight", (...\\1 -> q...)), ("layer.k_proj.weight", ...)]``.
    The table only uses escaped dots and ``(a|b)`` groups; anything else is an error.
    """
    groups = [g.split("|") for g in _GROUP.findall(rule.megatron)]
    out = []
    for choice in itertools.product(*groups) if groups else [()]:
        picks = iter(choice)
        meg = _GROUP.sub(lambda _m, picks=picks: next(picks), rule.megatron).replace("\\.", ".")
        if re.search(r"[\\\[\]()*+?|{}^$]", meg):
            raise ValueError(
                f"kimi_megatron_plugin.mapping rule {rule.megatron!r}: only '\\.' and '(a|b)' "
                "can be expanded into Bridge wildcard mappings"
            )
        hf = []
        for t in rule.hf:
            for i, c in enumerate(choice, start=1):
                t = t.replace(f"\\{i}", c)
            hf.append(t)
        out.append((meg, tuple(hf)))
    return out


def _fill(template: str, kimi, expert: int | None = None) -> str:
    lp = f"{kimi.lm_prefix}model.layers.*"
    s = template.replace("{moe}", f"{lp}.{kimi.moe_prefix}").replace("{lp}", lp).replace("{lm}", kimi.lm_prefix)
    if "{e}" in s:
        s = s.replace("{e}", str(expert)).format(**dict(zip(("gate", "up", "down"), kimi.expert_names)))
    return s


class _KimiMapping:
    """Carries the Kimi config through Bridge's ``resolve`` (which rebuilds mappings from two names)."""

    kimi = None
    extra: dict = {}

    def _with(self, kimi, **extra):
        self.kimi, self.extra = kimi, extra
        # logical expert weights have no tensor of that name on disk (the bridge dequantizes
        # <name>.weight_packed/.weight_scale), so Bridge must not drop the task for a missing key
        self.allow_hf_name_mismatch = extra.get("kind") == "weight"
        return self

    def resolve(self, captures):
        meg, hf = self._resolve_names(captures)
        return type(self)(meg, hf)._with(self.kimi, **self.extra)


class KimiHookedColumnMapping(_KimiMapping, ColumnParallelMapping):
    """Column-parallel tensor with a paired import/export quirk hook (:data:`mapping.HOOKS`), e.g. ``A_log``."""

    def hf_to_megatron(self, hf_weights, megatron_module):
        imp, _ = mapping.HOOKS[self.extra["hook"]]
        return super().hf_to_megatron(imp(hf_weights, self.kimi, str(self.hf_param)), megatron_module)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        _, exp = mapping.HOOKS[self.extra["hook"]]
        return {k: exp(v, self.kimi, k) for k, v in super().megatron_to_hf(megatron_weights, megatron_module).items()}


class KimiExpertStackMapping(_KimiMapping, MegatronParamMapping):
    """``decoder.layers.*.mlp.experts.<proj>_<packed|scale|weight>`` ``[E_local, ...]`` <-> one HF tensor per expert.

    ``hf_param`` is ``{"<global expert id>": HF name}`` for this rank's experts (expert-parallel
    rank ``r`` holds ids ``r*E_local ... (r+1)*E_local - 1``). :meth:`hf_to_megatron` checks each
    packed tensor's dtype against ``quantization_config.format`` (errors name the tensor) and stacks
    them; :meth:`megatron_to_hf` unstacks (expert parallelism 1 only; the native exporter
    :func:`kimi_megatron_plugin.checkpoint.export_hf_state_dict` gathers over EP).
    """

    def hf_to_megatron(self, hf_weights: dict[str, torch.Tensor], megatron_module) -> torch.Tensor:
        fmt = self.kimi.quant.format if self.kimi.quant is not None else None
        kind = self.extra.get("kind")
        pieces = []
        for e, name in sorted(self.hf_param.items(), key=lambda kv: int(kv[0])):
            t = hf_weights[e]
            if kind in ("packed", "scale"):
                if fmt is None:
                    raise TypeError(
                        f"{name} is a packed 4-bit tensor but config.json declares no quantization_config "
                        f"(expected one of {sorted(WEIGHT_FORMATS)})"
                    )
                want = weight_format(fmt)
                exp = want.packed_dtype if kind == "packed" else want.scale_dtype
                if t.dtype != exp:
                    raise TypeError(
                        f"{name} is {t.dtype}, but quantization_config.format={fmt!r} stores {exp} "
                        f"(megatron {self.megatron_param})"
                    )
            pieces.append(t)
        return torch.stack(pieces)

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if megatron_weights is None:
            return {}
        if self.ep_size > 1:
            raise NotImplementedError(
                "KimiExpertStackMapping exports with expert parallelism 1; use "
                "kimi_megatron_plugin.checkpoint.export_hf_state_dict under EP"
            )
        ids = sorted(self.hf_param, key=int)
        return {self.hf_param[e]: megatron_weights[i] for i, e in enumerate(ids)}


def _local_experts(kimi) -> list[int]:
    from megatron.core import parallel_state as ps

    ep_rank, ep = (
        (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
        if ps.is_initialized()
        else (0, 1)
    )
    n = kimi.n_routed_experts
    if n % ep:
        raise ValueError(f"n_routed_experts={n} is not divisible by expert_model_parallel_size={ep}")
    n_local = n // ep
    return list(range(ep_rank * n_local, (ep_rank + 1) * n_local))


def build_mapping_registry(kimi) -> MegatronMappingRegistry:
    """Bridge mappings for every rule of :data:`mapping.RULES`, with ``kimi``'s prefixes and expert names.

    :param kimi: :class:`kimi_core.config.KimiConfig` of the checkpoint.
    """
    out: list[MegatronParamMapping] = []
    for rule in mapping.RULES:
        for meg, hfs in expand_rule(rule):
            meg = "decoder.layers.*." + meg[len("layer.") :] if meg.startswith("layer.") else meg
            if rule.split == "expert":
                kind = meg.rsplit("_", 1)[1]  # packed | scale | weight
                hf = {str(e): _fill(hfs[0], kimi, e) for e in _local_experts(kimi)}
                out.append(KimiExpertStackMapping(meg, hf)._with(kimi, kind=kind))
            elif rule.hook:
                out.append(KimiHookedColumnMapping(meg, _fill(hfs[0], kimi))._with(kimi, hook=rule.hook))
            elif rule.split == "glu":
                out.append(GatedMLPMapping(meg, gate=_fill(hfs[0], kimi), up=_fill(hfs[1], kimi)))
            else:
                cls = {"rep": ReplicatedMapping, "col": ColumnParallelMapping, "row": RowParallelMapping}[rule.split]
                out.append(cls(meg, _fill(hfs[0], kimi)))
    return MegatronMappingRegistry(*out)
