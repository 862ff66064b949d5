"""LoRA on the routed experts of one MoE layer (:class:`kimi_megatron_plugin.models.experts.KimiExperts`).

Per projection (``gate``/``up``/``down``; HF ``gate_proj/up_proj/down_proj`` or ``w1/w3/w2``) the
factors are held as ``A [nA, r, in]`` and ``B [nB, out, r]``, ``n`` = local experts or 1 (shared):

================  ============================  ============================
layout            gate / up                     down
================  ============================  ============================
``per_expert``    ``A [E_local, r, in]``,       ``A [E_local, r, inter]``,
                  ``B [E_local, inter, r]``     ``B [E_local, out, r]``
``shared_outer``  ``A [1, r, in]`` (one per      ``A [E_local, r, inter]``,
                  layer), ``B [E_local, ...]``  ``B [1, out, r]`` (one per layer)
================  ============================  ============================

``shared_outer`` is SGLang's ``--experts-shared-outer-loras`` (gate_up A and down B shared) and
miles' K3 expert LoRA. The rank is ``LoraSpec.expert_rank(top_k)`` (``rank // top_k`` with
``normalize_moe_lora``). The delta is added to each grouped GEMM output of the frozen W4A16
experts (``KimiExperts.lora_delta``); gradients reach the activations through the base
(dgrad kernel / exact dequant) and the factors through this module.

Expert parallelism: per-expert factors are local (this rank's experts only, nothing to reduce);
the shared factors are replicated on every EP rank and see only the local experts' tokens, so
their gradients are summed over the expert-parallel group (:meth:`LoraExperts.shared_parameters`,
reduced by :meth:`kimi_megatron_plugin.lora.apply.KimiLora.finalize_grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_core.reference.ops import acc_dtype

__all__ = ["LoraExperts"]

PROJ = ("gate", "up", "down")


class LoraExperts(torch.nn.Module):
    """LoRA factors of this rank's experts of one MoE block.

    :param moe: HF MoE module name (``model.layers.1.mlp``); ``hf_proj``: HF names of (gate, up, down).
    :param shapes: ``{proj: (out, in)}`` of one expert (from ``KimiExperts.shapes``).
    :param targeted: the projections the spec selects.
    :param expert_offset: global id of local expert 0 (``ep_rank * E_local``).
    """

    def __init__(
        self,
        moe: str,
        hf_proj: tuple[str, str, str],
        shapes: dict,
        num_local: int,
        num_experts: int,
        expert_offset: int,
        rank: int,
        scaling: float,
        layout: str,
        targeted,
        device=None,
    ):
        super().__init__()
        if layout not in ("per_expert", "shared_outer"):
            raise ValueError(f"LoraExperts({moe}): expert_layout={layout!r}; expected per_expert or shared_outer")
        self.moe, self.hf_proj, self.layout = moe, dict(zip(PROJ, hf_proj)), layout
        self.E, self.num_experts, self.offset = num_local, num_experts, expert_offset
        self.rank, self.scaling, self.shapes = rank, float(scaling), dict(shapes)
        self.targeted = tuple(p for p in PROJ if p in targeted)
        self.shared: dict[str, tuple[bool, bool]] = {}  # proj -> (A shared, B shared)
        for p in self.targeted:
            out, inp = shapes[p]
            self.shared[p] = (
                layout == "shared_outer" and p in ("gate", "up"),
                layout == "shared_outer" and p == "down",
            )
            nA = 1 if self.shared[p][0] else num_local
            nB = 1 if self.shared[p][1] else num_local
            setattr(self, f"{p}_A", torch.nn.Parameter(torch.zeros(nA, rank, inp, device=device)))
            setattr(self, f"{p}_B", torch.nn.Parameter(torch.zeros(nB, out, rank, device=device)))

    def factors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if proj not in self.targeted:
            return None
        return getattr(self, f"{proj}_A"), getattr(self, f"{proj}_B")

    def shared_parameters(self) -> list[torch.nn.Parameter]:
        """Factors replicated across the EP group (``[1, ...]``): their gradients are summed over EP."""
        out = []
        for p in self.targeted:
            for t, shared in zip(self.factors(p), self.shared[p]):
                if shared:
                    out.append(t)
        return out

    # ------------------------------------------------------------------ full <-> local
    @torch.no_grad()
    def set_full(self, proj: str, A: torch.Tensor, B: torch.Tensor) -> None:
        """Set from all experts' stacks ``A [E or 1, r, in]``, ``B [E or 1, out, r]`` (global expert order)."""
        pA, pB = self.factors(proj)
        for src, dst, ab in ((A, pA, "lora_A"), (B, pB, "lora_B")):
            n = src.shape[0]
            if n not in (1, self.num_experts) or tuple(src.shape[1:]) != tuple(dst.shape[1:]):
                raise ValueError(
                    f"{self.moe}.experts.{self.hf_proj[proj]}.{ab}: shape {tuple(src.shape)}; expected "
                    f"[{self.num_experts} or 1, {', '.join(map(str, dst.shape[1:]))}]"
                )
            if self.shared[proj][0 if ab == "lora_A" else 1]:
                if n != 1 and not bool((src == src[:1]).all()):
                    raise ValueError(
                        f"{self.moe}.experts.{self.hf_proj[proj]}.{ab} differs between experts, but "
                        "expert_layout='shared_outer' holds one factor per layer; train it per_expert"
                    )
                dst.copy_(src[:1])
            else:
                local = src.expand(self.num_experts, *src.shape[1:]) if n == 1 else src
                dst.copy_(local[self.offset : self.offset + self.E])

    def full(self, proj: str, ep_group=None, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' ``(A [E or 1, r, in], B [E or 1, out, r])`` (``grad``: their gradients);
        collective over EP."""
        from kimi_megatron_plugin.checkpoint import all_gather_cat
        from kimi_megatron_plugin.lora.layers import factor_value

        A, B = (factor_value(t, grad) for t in self.factors(proj))
        sA, sB = self.shared[proj]
        return (A if sA else all_gather_cat(A, 0, ep_group)), (B if sB else all_gather_cat(B, 0, ep_group))

    # ------------------------------------------------------------------ maths
    def delta(self, x: torch.Tensor, proj: str, splits: list[int]) -> torch.Tensor | None:
        """LoRA part of ``proj`` for ``x [T, in]`` sorted by local expert (``splits`` tokens each);
        ``[T, out]`` in the accumulation dtype, or ``None`` if ``proj`` is not targeted."""
        f = self.factors(proj)
        if f is None:
            return None
        A, B = f
        a = acc_dtype(x.dtype)
        x = x.to(a)
        if A.shape[0] == 1:
            u = F.linear(x, A[0].to(a))  # one GEMM for all experts' tokens
        else:
            u = torch.cat([F.linear(xe, A[e].to(a)) for e, xe in enumerate(x.split(splits))])
        if B.shape[0] == 1:
            y = F.linear(u, B[0].to(a))
        else:
            y = torch.cat([F.linear(ue, B[e].to(a)) for e, ue in enumerate(u.split(splits))])
        return self.scaling * y

    def extra_repr(self) -> str:
        return f"{self.moe}, layout={self.layout}, E_local={self.E}, r={self.rank}, targets={self.targeted}"
