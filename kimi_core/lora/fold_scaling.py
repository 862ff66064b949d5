"""Fold per-module LoRA scaling into ``lora_B`` for readers that apply one global ``alpha / r``.

PEFT gives module ``m`` the scaling ``alpha_m / r_m`` from ``rank_pattern`` / ``alpha_pattern``
(:func:`kimi_core.lora.config.module_rank_alpha`). Capacity-normalised expert adapters
(``normalize_moe_lora``) depend on it: rank-16 dense modules at ``alpha / 16`` and rank-4 experts at
``alpha / 4``. A reader without the patterns (vLLM 0.26's ``PEFTHelper`` has no ``rank_pattern``
field: it filters the key out and scales every module by ``lora_alpha / r``) would under-scale the
experts by ``r / r_e`` (4x for top-4) and serve a different policy without any error.

:func:`fold_pattern_scaling` rewrites such an adapter so that the global rule gives the same
result: ``B_m <- B_m * s_m / s`` (``s_m`` the module's PEFT scaling, ``s`` the global one) and the
patterns are dropped. The delta ``s * B'_m A_m = s_m * B_m A_m`` is unchanged, in exact arithmetic;
``B'`` is computed in fp32 and stored in ``B``'s dtype (fp32 adapters fold exactly whenever
``s_m / s`` is a power of two, as it is for ``rank // top_k`` experts at equal alpha).
"""

from __future__ import annotations

import math

from kimi_core.lora.adapter import Adapter, AdapterError
from kimi_core.lora.config import META_KEY, module_rank_alpha, scaling_for

__all__ = ["fold_pattern_scaling", "has_patterns", "PEFT_PREFIX"]

#: prefix of every tensor name in a PEFT adapter file
PEFT_PREFIX = "base_model.model."


def has_patterns(adapter_config: dict) -> bool:
    """True when ``rank_pattern`` or ``alpha_pattern`` is non-empty (some module's scaling differs)."""
    return bool(adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"))


def fold_pattern_scaling(adapter: Adapter) -> Adapter:
    """A copy of ``adapter`` whose every module is served correctly by a global ``lora_alpha / r``.

    ``lora_B`` of each module whose PEFT scaling differs from the global one is multiplied by their
    ratio; ``rank_pattern`` / ``alpha_pattern`` become empty and ``r`` becomes the largest rank
    (a reader's ``max_lora_rank`` check then sees every module's rank). The original ``r`` /
    ``lora_alpha`` and the ratio applied are kept under ``kimi_rl.folded_scaling`` for the record.
    An adapter without patterns is returned unchanged (a copy).

    :raises AdapterError: a ``lora_B`` tensor without its module's scaling being resolvable
        (its ``lora_A`` is missing), naming the tensor.
    """
    out = adapter.copy()
    cfg = out.adapter_config
    if not has_patterns(cfg):
        return out
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    ranks = {}
    for name, t in out.tensors.items():
        if name.endswith(".lora_A.weight"):
            ranks[name[: -len(".lora_A.weight")]] = int(t.shape[0])
    r_max = max([r, *ranks.values()])
    # the global scaling after the fold: alpha' / r_max with alpha' chosen so that it equals alpha / r
    s_glob = scaling_for(cfg, r, alpha)
    alpha_new = s_glob * (math.sqrt(r_max) if cfg.get("use_rslora") else r_max)
    ratios: dict[str, float] = {}
    for name in list(out.tensors):
        if not name.endswith(".lora_B.weight"):
            continue
        key = name[: -len(".lora_B.weight")]
        if key not in ranks:
            raise AdapterError(f"{adapter.source}: {name} has no {key}.lora_A.weight; cannot resolve its scaling")
        module = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        r_m, a_m = module_rank_alpha(cfg, module)
        ratio = scaling_for(cfg, r_m, a_m) / s_glob
        if ratio != 1.0:
            b = out.tensors[name]
            out.tensors[name] = (b.float() * ratio).to(b.dtype)
            ratios[module] = ratio
    meta = dict(cfg.get(META_KEY) or {})
    meta["folded_scaling"] = {"r": r, "lora_alpha": alpha, "ratios": sorted(set(ratios.values()))}
    cfg.update(r=r_max, lora_alpha=alpha_new, rank_pattern={}, alpha_pattern={})
    cfg[META_KEY] = meta
    return out
