"""LoRA factors for the Megatron-Core linears of the Kimi models, and their parallel maths.

Delta of one target: ``delta(x) = scaling * (x @ A.T) @ B.T`` with ``A [r, in]``, ``B [out, r]``,
computed in fp32 (fp64 for an fp64 model) and added to the base output before the cast back, as
``kimi_core.reference.ops.linear`` does. The base module is never replaced: a forward hook adds
the delta to its output, so megatron's parameter names (and the HF mapping, the checkpoint
loader and the exporter) are unchanged.

Tensor parallelism (``kind``), for a base ``W [out, in]``:

=========  ==========================  ==========================  =====================================
kind       base                        local factors               communication
=========  ==========================  ==========================  =====================================
``col``    ``ColumnParallelLinear``,   ``A [r, in]`` replicated,   ``u = x A^T`` then identity forward /
           output split on ``out``     ``B [out/tp, r]``           all-reduce of ``du`` backward, so
                                                                   ``dA`` and ``dx`` are complete
``row``    ``RowParallelLinear``,      ``A [r, in/tp]``,           ``u`` = all-reduce of the partial
           input split on ``in``       ``B [out, r]`` replicated   ``x_local A_local^T`` (identity backward)
``rep``    replicated (or a split      ``A``, ``B`` whole          none
           linear whose weight is
           whole on this rank)
=========  ==========================  ==========================  =====================================

The communication on the rank-``r`` intermediate (not on ``x`` or the output) is the cheap place
for it (Megatron-Bridge's ``ParallelLinearAdapter`` makes the same choice; facts only, no code).
The two autograd functions below are ours: megatron's ``copy_to_tensor_model_parallel_region``
returns an un-reduced gradient when it is not contiguous (docs/megatron.md), which a rank-``r``
slice easily is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_core.reference.ops import acc_dtype

__all__ = ["LoraLinear", "copy_to_group", "reduce_from_group", "group_size", "add_delta", "factor_value"]


def group_size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group) if group_size(group) > 1 else x


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group) if group_size(group) > 1 else x


def add_delta(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``y + delta`` summed in the accumulation dtype and cast back to ``y.dtype`` (the reference's rule)."""
    a = acc_dtype(y.dtype)
    return (y.to(a) + delta).to(y.dtype)


def factor_value(p: torch.nn.Parameter, grad: bool) -> torch.Tensor:
    """A LoRA factor's detached value, or its gradient (zeros before any backward) when ``grad``."""
    if not grad:
        return p.detach()
    return p.grad.detach() if p.grad is not None else torch.zeros_like(p.detach())


class LoraLinear(torch.nn.Module):
    """This rank's LoRA factors of one HF module on one megatron linear.

    :param module: HF module name (``...self_attn.q_a_proj``), for errors and export.
    :param in_features, out_features: full (HF) sizes; ``rank``, ``scaling``: from the spec.
    :param kind: ``col`` | ``row`` | ``rep`` (module docstring); ``tp_group``, ``tp_rank``: the TP group.
    :ivar A: ``[r, in]`` (``row``: ``[r, in/tp]``) fp32 parameter; ``B``: ``[out, r]`` (``col``: ``[out/tp, r]``).
    """

    def __init__(
        self,
        module: str,
        in_features: int,
        out_features: int,
        rank: int,
        scaling: float,
        kind: str = "rep",
        tp_group=None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
    ):
        super().__init__()
        if kind not in ("col", "row", "rep"):
            raise ValueError(f"LoraLinear({module}): kind={kind!r}; expected col, row or rep")
        if kind == "col" and out_features % tp_size or kind == "row" and in_features % tp_size:
            raise ValueError(
                f"LoraLinear({module}): [{out_features}, {in_features}] is not divisible by "
                f"--tensor-model-parallel-size {tp_size}"
            )
        self.module, self.kind, self.scaling = module, kind, float(scaling)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        i = in_features // tp_size if kind == "row" else in_features
        o = out_features // tp_size if kind == "col" else out_features
        self.A = torch.nn.Parameter(torch.zeros(rank, i, device=device))
        self.B = torch.nn.Parameter(torch.zeros(o, rank, device=device))

    # ------------------------------------------------------------------ full <-> local
    def local_slice(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's pieces of full ``A [r, in]``, ``B [out, r]``."""
        if tuple(A.shape) != (self.rank, self.in_features) or tuple(B.shape) != (self.out_features, self.rank):
            raise ValueError(
                f"{self.module}: LoRA factors lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}; "
                f"expected [{self.rank}, {self.in_features}] / [{self.out_features}, {self.rank}]"
            )
        if self.kind == "col":
            B = B.chunk(self.tp_size, dim=0)[self.tp_rank]
        elif self.kind == "row":
            A = A.chunk(self.tp_size, dim=1)[self.tp_rank]
        return A, B

    @torch.no_grad()
    def set_full(self, A: torch.Tensor, B: torch.Tensor) -> None:
        a, b = self.local_slice(A, B)
        self.A.copy_(a)
        self.B.copy_(b)

    def full(self, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A, B)`` (``grad``: their gradients, zeros if none); collective over TP for
        ``col``/``row``, so every TP rank must call it."""
        from kimi_megatron_plugin.checkpoint import all_gather_cat

        A, B = (factor_value(self.A, grad), factor_value(self.B, grad))
        if self.kind == "col":
            B = all_gather_cat(B, 0, self.tp_group)
        elif self.kind == "row":
            A = all_gather_cat(A, 1, self.tp_group)
        return A, B

    # ------------------------------------------------------------------ maths
    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * (x @ A.T) @ B.T`` in the accumulation dtype; ``x [..., in(/tp for row)]``."""
        a = acc_dtype(x.dtype)
        u = F.linear(x.to(a), self.A.to(a))
        if self.kind == "col":
            u = copy_to_group(u, self.tp_group)
        elif self.kind == "row":
            u = reduce_from_group(u, self.tp_group)
        return self.scaling * F.linear(u, self.B.to(a))

    def extra_repr(self) -> str:
        return f"{self.module}, r={self.rank}, in={self.in_features}, out={self.out_features}, kind={self.kind}"
