"""Resolve an adapter of any layout into per-module fp32 factors: the API the reference oracle,
the engine plugins and the trainer read adapters through.

>>> ad = load_adapter("/tmp/adapter", config, max_rank=32)           # doctest: +SKIP
>>> f = ad.dense("model.layers.1.self_attn.q_a_proj")                  # doctest: +SKIP
>>> y = x @ W.T + f.scaling * (x @ f.A.T) @ f.B.T                      # doctest: +SKIP
>>> ad.expert("model.layers.1.mlp", 5, "gate_proj")                    # doctest: +SKIP

Validation happens once, in :func:`load_adapter`, before anything is used: missing file, unknown
module, shape mismatch against the config, NaN/Inf, ``lora_A`` without ``lora_B``, rank above
``max_rank``, rank disagreeing with ``r``/``rank_pattern``. Every error names the file and tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kimi_core.lora.adapter import Adapter, AdapterError
from kimi_core.lora.config import META_KEY, AdapterConfigError, scaling_for, validate_adapter_config
from kimi_core.lora.layouts import Decomposed, decompose, detect_layout
from kimi_core.lora.naming import canonical_proj, normalize_module

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = ["LoraFactors", "ExpertStack", "ResolvedAdapter", "load_adapter"]


@dataclass(frozen=True)
class LoraFactors:
    """One LoRA pair: ``A [r, in]`` fp32, ``B [out, r]`` fp32 and ``scaling`` (``alpha / r``).

    ``delta(x) = scaling * (x @ A.T) @ B.T``.
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * (x @ A.T) @ B.T`` for ``x [..., in]`` (computed in ``x``'s dtype)."""
        return self.scaling * ((x @ self.A.T.to(x.dtype)) @ self.B.T.to(x.dtype))

    def delta_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The merged update ``scaling * B @ A`` ``[out, in]``."""
        return self.scaling * (self.B.to(dtype) @ self.A.to(dtype))


@dataclass(frozen=True)
class ExpertStack:
    """Factors of one projection of every expert of a MoE block: ``A [n, r, in]``, ``B [n, out, r]``
    (fp32; ``n`` is the number of experts in ``expert_range`` or 1 when shared by all experts)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    expert_range: tuple[int, int]


class AdapterLookup(Protocol):
    """What the reference modules ask of an adapter: the factors of one dense module or one routed expert.

    :class:`ResolvedAdapter` (a loaded PEFT adapter) and :class:`kimi_core.lora.trainable.TrainableAdapter`
    (trainable parameters) both provide it.
    """

    def dense(self, module: str) -> LoraFactors | None: ...

    def expert(self, moe_module: str, expert: int, proj: str) -> LoraFactors | None: ...


class ResolvedAdapter:
    """A validated adapter, resolved to fp32 factors per module and per expert.

    :ivar config: the ``KimiConfig`` it was validated against.
    :ivar adapter_config: the PEFT dict.
    :ivar layout: file layout found (``per_expert``, ``per_expert_3d``, ``shared_outer``,
        ``stacked``, or ``None`` when there are no expert factors).
    :ivar source: file (or ``<memory>``) it came from.
    """

    def __init__(self, dec: Decomposed, config: KimiConfig, adapter_config: dict, source: str):
        self.config = config
        self.adapter_config = adapter_config
        self.source = source
        self.layout = detect_layout(dec)
        self.expert_range = dec.expert_range
        f32 = torch.float32
        self._dense = {
            m: LoraFactors(A.to(f32).contiguous(), B.to(f32).contiguous(), self._scaling(m, A.shape[0], dec))
            for m, (A, B) in dec.dense.items()
        }
        self._experts: dict[tuple[str, str], ExpertStack] = {}
        cache: dict[int, torch.Tensor] = {}  # gate/up share A objects in the stacked form: convert once

        def f32c(t):
            k = id(t)
            if k not in cache:
                cache[k] = t.to(f32).contiguous()
            return cache[k]

        for key, (A, B) in dec.experts.items():
            self._experts[key] = ExpertStack(f32c(A), f32c(B), self._scaling(key, A.shape[1], dec), dec.expert_range)

    def _scaling(self, key: str, r: int, dec: Decomposed) -> float:
        rr, alpha = dec.rank_alpha.get(key, (r, float(self.adapter_config["lora_alpha"])))
        return scaling_for(self.adapter_config, rr, alpha)

    # -------------------------------------------------------------------------- lookups
    def dense(self, module: str) -> LoraFactors | None:
        """Factors of a non-expert module (full HF name without ``.weight``), ``None`` if it has none."""
        return self._dense.get(normalize_module(self.config, module))

    def expert(self, moe_module: str, expert: int, proj: str) -> LoraFactors | None:
        """Factors of routed ``expert`` of ``moe_module`` (e.g. ``model.layers.1.mlp``) for the HF
        projection ``proj`` (``gate_proj``/``up_proj``/``down_proj`` or ``w1``/``w3``/``w2``).
        ``None`` if the adapter has none (or the expert is outside ``expert_range``)."""
        st = self.expert_stack(moe_module, proj)
        lo, hi = self.expert_range
        if st is None or not lo <= expert < hi:
            return None
        i = expert - lo
        A = st.A[0] if st.A.shape[0] == 1 else st.A[i]
        B = st.B[0] if st.B.shape[0] == 1 else st.B[i]
        return LoraFactors(A, B, st.scaling)

    def expert_stack(self, moe_module: str, proj: str) -> ExpertStack | None:
        """All experts of one projection at once (for batched expert math), ``None`` if absent."""
        moe = normalize_module(self.config, moe_module)
        try:
            proj = canonical_proj(self.config, proj)
        except KeyError:
            return None
        return self._experts.get((moe, proj))

    def modules(self) -> list[str]:
        """Non-expert modules with factors."""
        return list(self._dense)

    def moe_modules(self) -> list[str]:
        """MoE blocks with expert factors."""
        return sorted({m for m, _ in self._experts})

    @property
    def max_rank(self) -> int:
        ranks = [f.rank for f in self._dense.values()] + [s.A.shape[1] for s in self._experts.values()]
        return max(ranks, default=0)

    def __repr__(self) -> str:
        return (
            f"ResolvedAdapter({self.source!r}, layout={self.layout}, dense={len(self._dense)}, "
            f"expert_groups={len(self._experts)}, max_rank={self.max_rank})"
        )


def load_adapter(
    path_or_dict,
    config: KimiConfig,
    *,
    max_rank: int | None = None,
    adapter_config: dict | None = None,
    expert_range: tuple[int, int] | None = None,
) -> ResolvedAdapter:
    """Load, validate and resolve an adapter.

    :param path_or_dict: a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``),
        an :class:`~kimi_core.lora.adapter.Adapter`, ``{"adapter_config": dict, "tensors":
        {name: tensor}}``, or a plain ``{name: tensor}`` mapping with ``adapter_config=`` given.
        Tensor names may carry ``base_model.model.`` or not; any layout of
        :mod:`kimi_core.lora.layouts` is accepted.
    :param config: the model's ``KimiConfig``.
    :param max_rank: reject any module whose rank exceeds it (the engine's ``max_lora_rank``).
    :param expert_range: ``(lo, hi)`` when the adapter holds only experts ``[lo, hi)`` (an
        expert-filtered bucket stream); read from the config's ``kimi_rl.expert_range`` otherwise.
    """
    if isinstance(path_or_dict, (str, os.PathLike)):
        ad = Adapter.load(path_or_dict)
    elif isinstance(path_or_dict, Adapter):
        ad = path_or_dict
    elif isinstance(path_or_dict, Mapping):
        if "tensors" in path_or_dict and "adapter_config" in path_or_dict:
            ad = Adapter(
                dict(path_or_dict["tensors"]),
                path_or_dict["adapter_config"],
                source=path_or_dict.get("source", "<memory>"),
            )
        else:
            if adapter_config is None:
                raise AdapterError(
                    "load_adapter: a plain tensor dict needs adapter_config= (the PEFT dict with "
                    "r and lora_alpha), or pass {'adapter_config': ..., 'tensors': ...}"
                )
            ad = Adapter(dict(path_or_dict), adapter_config)
    else:
        raise AdapterError(
            f"load_adapter: expected a directory path, an Adapter or a dict, got {type(path_or_dict).__name__}"
        )
    if adapter_config is not None:
        ad = Adapter(ad.tensors, adapter_config, ad.source)
    try:
        validate_adapter_config(ad.adapter_config, ad.source)
    except AdapterConfigError as e:
        raise AdapterError(str(e)) from None
    if not ad.tensors:
        raise AdapterError(f"{ad.source}: adapter has no tensors")
    if expert_range is None:
        rng = (ad.adapter_config.get(META_KEY) or {}).get("expert_range")
        expert_range = tuple(rng) if rng else None
    dec = decompose(
        ad.tensors, config, ad.adapter_config, where=ad.source, expert_range=expert_range, max_rank=max_rank
    )
    return ResolvedAdapter(dec, config, ad.adapter_config, ad.source)
