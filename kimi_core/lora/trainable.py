"""Trainable LoRA factors as ``nn.Parameter``s, viewed through the :class:`ResolvedAdapter` contract.

A trainer that runs a model which calls ``adapter.dense(module)`` / ``adapter.expert(moe, e, proj)``
(``kimi_core.reference``) can train an adapter by passing a :class:`TrainableAdapter`: the factors
it returns are the parameters themselves, so gradients flow into them. ``export()`` gives a plain
:class:`~kimi_core.lora.adapter.Adapter` in the per-expert PEFT layout, ready for the engines.

Initialisation follows PEFT: ``lora_A`` ~ N(0, 1/in), ``lora_B`` = 0, so a fresh adapter is exactly
the base model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi_core.lora.adapter import Adapter
from kimi_core.lora.config import LoraSpec
from kimi_core.lora.naming import iter_targets, lora_names
from kimi_core.lora.resolve import LoraFactors

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig


class TrainableAdapter(torch.nn.Module):
    """LoRA factors of every target of ``spec`` on ``config`` (per-expert layout), fp32 parameters.

    :param config: :class:`kimi_core.config.KimiConfig`.
    :param spec: :class:`LoraSpec` (``expert_layout`` must be ``per_expert``).
    """

    def __init__(self, config: KimiConfig, spec: LoraSpec, seed: int = 0):
        super().__init__()
        if spec.expert_layout != "per_expert":
            raise ValueError(
                f"TrainableAdapter trains per-expert factors; LoraSpec.expert_layout={spec.expert_layout!r}"
            )
        self.config, self.spec = config, spec
        g = torch.Generator().manual_seed(seed)
        self.params = torch.nn.ParameterDict()
        self._keys: dict[str, tuple[str, str, float]] = {}
        r_e = spec.expert_rank(config.num_experts_per_tok)
        for t in iter_targets(config, spec):
            a_name, b_name = lora_names(t.module)
            ka, kb = a_name.replace(".", "/"), b_name.replace(".", "/")  # ParameterDict keys may not contain '.'
            self.params[ka] = torch.nn.Parameter(torch.randn(t.rank, t.in_features, generator=g) * t.in_features**-0.5)
            self.params[kb] = torch.nn.Parameter(torch.zeros(t.out_features, t.rank))
            alpha = spec.expert_alpha_value() if t.is_expert else float(spec.alpha)
            self._keys[t.module] = (ka, kb, spec.scaling(r_e if t.is_expert else spec.rank, alpha))

    def dense(self, module: str) -> LoraFactors | None:
        k = self._keys.get(module)
        return None if k is None else LoraFactors(self.params[k[0]], self.params[k[1]], k[2])

    def expert(self, moe_module: str, expert: int, proj: str) -> LoraFactors | None:
        return self.dense(f"{moe_module}.experts.{expert}.{proj}")

    def export(self, dtype: torch.dtype = torch.bfloat16) -> Adapter:
        """The adapter as PEFT tensors (per-expert 2-D names) plus ``adapter_config``."""
        tensors = {k.replace("/", "."): p.detach().to(dtype).clone() for k, p in self.params.items()}
        return Adapter(tensors, self.spec.to_adapter_config(self.config, "per_expert"), source="<trainable>")
