"""Routed experts of Kimi on Megatron-Core: W4A16 (packed 4-bit, frozen) or BF16 master with fake-quant QAT.

:class:`KimiExperts` is the ``experts`` module of :class:`kimi_megatron_plugin.models.mlp.KimiMoELayer`
(megatron's experts contract: ``forward(permuted_tokens [T, D], tokens_per_expert [E_local],
permuted_probs [T]) -> (out [T, D], None)``, tokens sorted by local expert). Modes:

``"w4a16"`` (default)
    The checkpoint's packed bytes are the only copy of the weights: frozen buffers
    ``{gate,up,down}_packed`` / ``{gate,up,down}_scale`` ``[E_local, out, in/8|in/2]`` /
    ``[E_local, out, in/32]`` in the dtypes of :mod:`kimi_core.quant.formats` (``INT4``: int32 + bf16
    scales, K2.x; ``MXFP4``: uint8 + E8M0 uint8, K3/K3.1), about 0.56 / 0.53 bytes per parameter.
    bf16 activations go through :func:`kimi_core.kernels.w4a16_grouped_linear` (Triton on GPU,
    torch twin on CPU; gradients reach the activations only). Other activation dtypes (the fp32
    numerics tests) dequantize one expert at a time, exactly, in that dtype.
``"qat"``
    Trainable master weights ``{gate,up,down}_weight [E_local, out, in]`` in ``params_dtype``; the
    forward uses the served grid: fake INT4 with configurable ``scale_divisor``/``q_min`` (Kimi
    7.0/-7, RTN 7.5/-8) or fake MXFP4, straight-through in the backward (SkyRL's K2.x recipe).
``"dense"``
    Plain trainable master weights, no fake quantization (unquantized checkpoints; the BF16 baseline of the
    W4A16 slice benchmark). bf16 weights and activations go through
    :func:`kimi_core.kernels.bf16_grouped.bf16_grouped_linear` (one ``torch._grouped_mm`` on sm90 / CPU).

Experts are never split by tensor parallelism here (``expert_tensor_parallel_size`` must be 1);
expert parallelism gives each rank ``num_experts / EP`` whole experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from kimi_core.quant import get_format
from kimi_core.quant.formats import INT4, WeightFormat, weight_format
from kimi_core.reference.ops import acc_dtype, glu
from kimi_megatron_plugin.models.parameters import compute_device

__all__ = ["KimiExperts", "EXPERT_MODES", "PROJ"]

EXPERT_MODES = ("w4a16", "qat", "dense")
PROJ = ("gate", "up", "down")  # megatron-side names of HF (gate_proj|w1, up_proj|w3, down_proj|w2)


def packed_shapes(
    fmt: WeightFormat, out: int, inp: int
) -> tuple[tuple[int, int], tuple[int, int], torch.dtype, torch.dtype]:
    """``(packed shape, scale shape, packed dtype, scale dtype)`` of one ``[out, inp]`` weight in ``fmt``."""
    if inp % fmt.group_size:
        raise ValueError(f"expert input width {inp} is not a multiple of the {fmt.short} group size {fmt.group_size}")
    return fmt.packed_shape(out, inp), fmt.scale_shape(out, inp), fmt.packed_dtype, fmt.scale_dtype


class KimiExperts(MegatronModule):
    """The local routed experts of one MoE layer (see the module docstring for the modes).

    :param num_local_experts: ``num_experts / EP``; ``kimi``: the :class:`~kimi_core.config.KimiConfig`.
    :param mode: ``"w4a16"``, ``"qat"`` or ``"dense"``.
    :param quant_format: 4-bit format (config string, short name or :class:`~kimi_core.quant.formats.WeightFormat`)
        for ``w4a16``/``qat``; default ``kimi.quant.format``. Held as ``self.fmt`` (a ``WeightFormat`` or None).
    :param scale_divisor, q_min: fake-INT4 grid of ``qat`` (default Kimi's 7.0 / -7).
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        kimi=None,
        mode: str = "w4a16",
        quant_format: str | WeightFormat | None = None,
        scale_divisor: float = 7.0,
        q_min: int = -7,
        **_,
    ):
        super().__init__(config=config)
        if mode not in EXPERT_MODES:
            raise ValueError(f"kimi_megatron_plugin: expert mode {mode!r}; expected one of {EXPERT_MODES}")
        if (config.expert_tensor_parallel_size or 1) != 1:
            raise ValueError(
                "kimi_megatron_plugin: --expert-tensor-parallel-size must be 1 (experts are whole per rank)"
            )
        self.kimi, self.mode, self.E = kimi, mode, num_local_experts
        fmt = quant_format or (kimi.quant.format if kimi.quant is not None else None)
        self.fmt = weight_format(fmt) if fmt is not None else None
        if mode != "dense" and self.fmt is None:
            raise ValueError(
                f"kimi_megatron_plugin: expert mode {mode!r} needs a 4-bit format, but config.json has "
                "no quantization_config; use mode 'dense' for an unquantized checkpoint"
            )
        self.scale_divisor, self.q_min = float(scale_divisor), int(q_min)
        d_in, d_ff = kimi.expert_in_size, kimi.moe_intermediate_size
        self.shapes = {"gate": (d_ff, d_in), "up": (d_ff, d_in), "down": (d_in, d_ff)}
        for p, (o, i) in self.shapes.items():
            if mode == "w4a16":
                ps, ss, pd, sd = packed_shapes(self.fmt, o, i)
                self.register_buffer(f"{p}_packed", torch.zeros(self.E, *ps, dtype=pd, device=compute_device()))
                self.register_buffer(f"{p}_scale", torch.zeros(self.E, *ss, dtype=sd, device=compute_device()))
            else:
                w = torch.nn.Parameter(torch.empty(self.E, o, i, dtype=config.params_dtype, device=compute_device()))
                if config.perform_initialization:
                    for e in range(self.E):
                        config.init_method(w.data[e])
                w.allreduce = False  # expert parameters: reduced over expert-data-parallel ranks only
                setattr(self, f"{p}_weight", w)

    # ------------------------------------------------------------------ weights
    def expert_weight(self, proj: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Local expert ``e``'s ``[out, in]`` weight as the forward sees it (dequantized / fake-quantized)."""
        if self.mode == "w4a16":
            packed, scale = getattr(self, f"{proj}_packed")[e], getattr(self, f"{proj}_scale")[e]
            return get_format(self.fmt.name).dequantize(packed, scale, dtype)
        w = getattr(self, f"{proj}_weight")[e]
        if self.mode == "qat":
            from kimi_core.kernels import fake_quant_gpu

            w = fake_quant_gpu(w, self.fmt, self.scale_divisor, self.q_min)
        return w.to(dtype)

    def packed(self, proj: str, e: int) -> dict[str, torch.Tensor]:
        """On-disk tensors (``weight_packed``, ``weight_scale``) of local expert ``e`` for export."""
        if self.mode == "w4a16":
            return {
                "weight_packed": getattr(self, f"{proj}_packed")[e].clone(),
                "weight_scale": getattr(self, f"{proj}_scale")[e].clone(),
            }
        w = getattr(self, f"{proj}_weight")[e].detach()
        if self.fmt is INT4:
            return get_format(self.fmt.name).quantize(w, self.scale_divisor, self.q_min)
        return get_format(self.fmt.name).quantize(w)

    # ------------------------------------------------------------------ forward
    #: optional LoRA, set by :mod:`kimi_megatron_plugin.lora` (a plain attribute, not a submodule, so
    #: the state dict and the HF mapping are unchanged): ``lora_delta(x [T, in], proj, splits)`` returns
    #: the ``[T, out]`` delta (accumulation dtype) added to the grouped GEMM output, or ``None``.
    lora_delta = None

    def _grouped(self, x: torch.Tensor, proj: str, splits: list[int]) -> torch.Tensor:
        y = self._grouped_base(x, proj, splits)
        d = (
            self.lora_delta(x, proj, splits.tolist() if torch.is_tensor(splits) else splits)
            if self.lora_delta is not None
            else None
        )
        return y if d is None else (y.to(d.dtype) + d).to(y.dtype)

    def _grouped_base(self, x: torch.Tensor, proj: str, splits: list[int]) -> torch.Tensor:
        if self.mode == "w4a16" and x.dtype == torch.bfloat16:
            from kimi_core.kernels import w4a16_grouped_linear

            return w4a16_grouped_linear(
                x.contiguous(), getattr(self, f"{proj}_packed"), getattr(self, f"{proj}_scale"), self.fmt, splits
            )
        if self.mode == "dense" and x.dtype == torch.bfloat16 and getattr(self, f"{proj}_weight").dtype == x.dtype:
            from kimi_core.kernels.bf16_grouped import bf16_grouped_linear

            return bf16_grouped_linear(x, getattr(self, f"{proj}_weight"), splits)
        outs = [
            F.linear(xe, self.expert_weight(proj, e, x.dtype)) if xe.shape[0] else x.new_zeros(0, self.shapes[proj][0])
            for e, xe in enumerate(x.split(splits.tolist() if torch.is_tensor(splits) else splits))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, self.shapes[proj][0])

    def forward(
        self, permuted_tokens: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor | None = None
    ):
        """``[T, D]`` tokens sorted by local expert -> ``(probs * E(x) [T, D], None)``."""
        # a tensor (CPU or device) goes to the grouped GEMMs as it is: the W4A16 kernels read a CPU tensor once per
        # split pattern and never read a device one back (no host sync); the per-expert paths take it as a list
        splits = tokens_per_expert if torch.is_tensor(tokens_per_expert) else [int(v) for v in tokens_per_expert]
        x = permuted_tokens
        h = glu(self.kimi, self._grouped(x, "gate", splits), self._grouped(x, "up", splits))
        y = self._grouped(h.to(x.dtype), "down", splits)
        if permuted_probs is not None:
            a = acc_dtype(y.dtype)
            y = (y.to(a) * permuted_probs.to(a).unsqueeze(-1)).to(x.dtype)
        return y, None
