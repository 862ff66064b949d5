"""Adapter sizes computed from a config, without building any tensor (``docs/lora.md`` table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.lora.config import LoraSpec
from kimi_core.lora.naming import iter_target_groups

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = ["adapter_nbytes", "adapter_numel_by_kind"]


def adapter_numel_by_kind(
    config: KimiConfig, spec: LoraSpec, layout: str | None = None, tie_gate_up_a: bool = True
) -> dict[str, int]:
    """Parameter count per target kind (``mla``, ``kda``, ``mlp``, ``shared_expert``, ``latent``,
    ``expert``, ``indexer``) for ``spec`` on ``config`` in file ``layout``.

    ``stacked`` holds one gate_up ``lora_A`` per expert: rank ``r`` when gate and up share A
    (``tie_gate_up_a``, the Megatron fused-fc1 case), else the exact form of rank ``2r``.
    """
    layout = layout or spec.expert_layout
    if layout == "shared_outer" and spec.expert_layout != "shared_outer":
        raise ValueError("layout='shared_outer' needs spec.expert_layout='shared_outer'")
    g, u, d = config.expert_names
    out: dict[str, int] = {}
    for grp in iter_target_groups(config, spec):
        r, fin, fout, E = grp.rank, grp.in_features, grp.out_features, grp.count
        if grp.kind != "expert":
            n = r * (fin + fout)
        elif layout == "shared_outer":
            # gate/up: one A, per-expert B; down: per-expert A, one B
            n = r * fin + E * r * fout if grp.proj in (g, u) else E * r * fin + r * fout
        elif layout == "stacked" and grp.proj in (g, u):
            if tie_gate_up_a:
                n = E * r * fout + (E * r * fin if grp.proj == g else 0)
            else:  # rank r_g + r_u with block-diagonal B: A rows and B columns both double
                n = E * r * fin + E * 2 * r * fout
        else:
            n = E * r * (fin + fout)
        out[grp.kind] = out.get(grp.kind, 0) + n
    return out


def adapter_nbytes(
    config: KimiConfig,
    spec: LoraSpec,
    layout: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    tie_gate_up_a: bool = True,
) -> int:
    """Bytes of the adapter tensors (``adapter_model.safetensors`` payload, headers excluded)."""
    size = torch.empty((), dtype=dtype).element_size()
    return size * sum(adapter_numel_by_kind(config, spec, layout, tie_gate_up_a).values())
