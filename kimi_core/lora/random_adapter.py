"""Random adapters for tests and benchmarks, in any layout.

Unlike a training init (``B = 0``) both factors are random, so every module's delta is nonzero
and a wrong name, rank fold or scaling shows up in the numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.lora.adapter import Adapter
from kimi_core.lora.config import LoraSpec
from kimi_core.lora.layouts import Decomposed, compose
from kimi_core.lora.naming import iter_target_groups

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = ["random_adapter"]


def random_adapter(
    config: KimiConfig,
    spec: LoraSpec,
    seed: int = 0,
    layout: str | None = None,
    dtype: torch.dtype = torch.float32,
    tie_gate_up_a: bool = False,
    b_std: float = 0.5,
) -> Adapter:
    """A random adapter for ``config`` with the targets, ranks and expert layout of ``spec``.

    :param layout: file layout (default ``spec.expert_layout``); ``per_expert`` and ``stacked``
        are always possible; ``shared_outer`` needs ``spec.expert_layout == "shared_outer"``.
    :param tie_gate_up_a: give gate and up of each expert the same ``lora_A`` (what a Megatron
        LoRA on the fused ``linear_fc1`` exports); then ``stacked`` keeps rank ``r``.
    :param b_std: ``lora_B`` std times ``r**-0.5``; ``lora_A`` std is ``in**-0.5``.
    :returns: an :class:`~kimi_core.lora.adapter.Adapter` whose tensors are in ``dtype``.
    """
    layout = layout or spec.expert_layout
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, std: float):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    dec = Decomposed(expert_range=(0, config.n_routed_experts))
    g, u, d = config.expert_names
    shared = spec.expert_layout == "shared_outer"
    for grp in iter_target_groups(config, spec):
        r, fin, fout = grp.rank, grp.in_features, grp.out_features
        if grp.kind != "expert":
            dec.dense[grp.module] = (rnd(r, fin, std=fin**-0.5), rnd(fout, r, std=b_std * r**-0.5))
            continue
        E = grp.count
        nA = 1 if shared and grp.proj in (g, u) else E
        nB = 1 if shared and grp.proj == d else E
        A = rnd(nA, r, fin, std=fin**-0.5)
        if tie_gate_up_a and grp.proj == u and (grp.moe, g) in dec.experts:
            A = dec.experts[(grp.moe, g)][0]
        dec.experts[(grp.moe, grp.proj)] = (A, rnd(nB, fout, r, std=b_std * r**-0.5))
    base = spec.to_adapter_config(config, "per_expert_3d")
    # rank/alpha of every group, as the spec defines them
    r_e, a_e = spec.expert_rank(config.num_experts_per_tok), spec.expert_alpha_value()
    for key in dec.experts:
        dec.rank_alpha[key] = (r_e, a_e)
    for key in dec.dense:
        dec.rank_alpha[key] = (spec.rank, float(spec.alpha))
    ad = compose(dec, config, layout, base)
    ad.source = f"<random_adapter seed={seed} layout={layout}>"
    return ad
