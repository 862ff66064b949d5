"""Put LoRA on a built Kimi ``GPTModel`` chunk by target/exclude lists (:func:`apply_lora`).

Targets come from :func:`kimi_core.lora.naming.iter_target_groups` (HF names, the spec's
target/exclude rules, capacity-normalised expert rank); which megatron module carries which HF
module comes from :mod:`kimi_megatron_plugin.mapping` (the plugin's one name table). Nothing is
renamed: the base model keeps its state dict, a forward hook adds the delta of
:class:`~kimi_megatron_plugin.lora.layers.LoraLinear` to each targeted linear, and
``KimiExperts.lora_delta`` adds :class:`~kimi_megatron_plugin.lora.experts.LoraExperts` to the
grouped expert GEMMs. The factors live in one :class:`KimiLora` module (give its parameters to
the optimizer); the base is frozen.

Initialisation (PEFT's): ``A ~ N(0, 1/in)``, ``B = 0``, drawn per HF module (per expert) from a
generator seeded by ``(seed, name)``, so every TP/EP/PP layout starts from the same adapter.

Example::

    lora = apply_lora(model, LoraSpec(rank=32, alpha=32, exclude_modules=("kv_b_proj",)))
    opt = torch.optim.AdamW(lora.parameters(), lr=1e-4)
    loss.backward(); lora.finalize_grads(); opt.step()
    adapter = lora.export()            # kimi_core.lora.Adapter, per-expert PEFT names
"""

from __future__ import annotations

import zlib

import torch

from kimi_core.errors import KimiError
from kimi_core.lora import LoraSpec, load_adapter
from kimi_core.lora.naming import iter_target_groups, moe_module
from kimi_megatron_plugin import mapping
from kimi_megatron_plugin.checkpoint import unwrap_model
from kimi_megatron_plugin.lora.experts import PROJ, LoraExperts
from kimi_megatron_plugin.lora.layers import LoraLinear, add_delta
from kimi_megatron_plugin.models.experts import KimiExperts

__all__ = ["KimiLora", "apply_lora", "LoraApplyError"]


class LoraApplyError(KimiError, ValueError):
    """The spec cannot be applied to this model; names the module and the flag."""


def _key(name: str) -> str:
    return name.replace(".", "/")  # ModuleDict keys may not contain '.'


def _randn_A(seed: int, name: str, rank: int, fan_in: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(rank, fan_in, generator=g) * fan_in**-0.5


def _parallel():
    from megatron.core import parallel_state as ps

    init = torch.distributed.is_initialized() and ps.model_parallel_is_initialized()
    if not init:
        return dict(tp_group=None, tp_rank=0, tp=1, ep_group=None, ep_rank=0, ep=1)
    return dict(
        tp_group=ps.get_tensor_model_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        ep_group=ps.get_expert_model_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
    )


class KimiLora(torch.nn.Module):
    """All LoRA factors of one model chunk on this rank, plus the hooks that apply them.

    :ivar dense: ``ModuleDict`` of :class:`LoraLinear` keyed by HF module name (``.`` -> ``/``).
    :ivar experts: ``ModuleDict`` of :class:`LoraExperts` keyed by HF MoE module name.
    :ivar spec: the :class:`LoraSpec`; ``config``: the ``KimiConfig``.
    """

    def __init__(self, config, spec: LoraSpec):
        super().__init__()
        self.config, self.spec = config, spec
        self.dense = torch.nn.ModuleDict()
        self.experts = torch.nn.ModuleDict()
        self._handles: list = []
        self._expert_modules: list[KimiExperts] = []
        self.par = _parallel()

    # ------------------------------------------------------------------ gradients
    def finalize_grads(self, dp_group=None, average: bool = False) -> None:
        """Reduce gradients after ``backward``: shared expert factors are summed over the EP group
        (each EP rank saw only its experts' tokens); with ``dp_group`` every factor is then summed
        (``average``: averaged) over data-parallel replicas (dense: ``dp_group``; experts: the
        expert-data-parallel group). Per-expert factors and TP pieces need nothing more."""
        ep_group = self.par["ep_group"]
        if self.par["ep"] > 1:
            for m in self.experts.values():
                for p in m.shared_parameters():
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad, group=ep_group)
        if dp_group is None:
            return
        from megatron.core import parallel_state as ps

        edp = ps.get_expert_data_parallel_group()
        for group, params in ((dp_group, list(self.dense.parameters())), (edp, list(self.experts.parameters()))):
            n = torch.distributed.get_world_size(group)
            if n == 1:
                continue
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=group)
                    if average:
                        p.grad.div_(n)

    # ------------------------------------------------------------------ set from an adapter
    @torch.no_grad()
    def load_adapter(self, adapter, max_rank: int | None = None) -> None:
        """Set every factor from an adapter of any layout (PEFT dir, :class:`~kimi_core.lora.Adapter`,
        dict); validated by :func:`kimi_core.lora.load_adapter` first. Missing modules, or a scaling
        that differs from this spec's, raise naming the module."""
        ra = load_adapter(adapter, self.config, max_rank=max_rank)
        for lin in self.dense.values():
            f = ra.dense(lin.module)
            if f is None:
                raise LoraApplyError(f"{ra.source}: no factors for LoRA target {lin.module!r}")
            _check_scaling(ra.source, lin.module, f.scaling, lin.scaling)
            lin.set_full(f.A, f.B)
        for m in self.experts.values():
            for p in m.targeted:
                st = ra.expert_stack(m.moe, m.hf_proj[p])
                name = f"{m.moe}.experts.{m.hf_proj[p]}"
                if st is None:
                    raise LoraApplyError(f"{ra.source}: no expert factors for LoRA target {name!r}")
                _check_scaling(ra.source, name, st.scaling, m.scaling)
                m.set_full(p, st.A, st.B)

    # ------------------------------------------------------------------ export / teardown
    def export(self, layout: str = "per_expert", dtype: torch.dtype = torch.bfloat16):
        """The whole adapter as a :class:`kimi_core.lora.Adapter` (see :func:`.export.export_adapter`)."""
        from kimi_megatron_plugin.lora.export import export_adapter

        return export_adapter(self, layout=layout, dtype=dtype)

    def remove(self) -> None:
        """Detach from the model (hooks and ``lora_delta`` removed); the factors stay here."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._expert_modules:
            m.lora_delta = None
        self._expert_modules.clear()


def _check_scaling(source, name, got: float, want: float) -> None:
    if abs(got - want) > 1e-12 * max(1.0, abs(want)):
        raise LoraApplyError(
            f"{source}: {name} has LoRA scaling {got:g} (alpha/r from its adapter_config), but the "
            f"trainer's LoraSpec gives {want:g}; use the same rank/alpha/normalize_moe_lora"
        )


def _dense_hook(parts: list[tuple[LoraLinear | None, int]]):
    """Forward hook adding the deltas of ``parts`` (one per HF module fused in the base output, in
    output order; ``None`` for an untargeted part of ``local_out`` columns)."""

    def hook(_mod, args, out):
        x = args[0]
        y = out[0] if isinstance(out, tuple) else out
        ds = []
        for lin, _width in parts:
            ds.append(lin.delta(x) if lin is not None else None)
        if len(ds) == 1:
            d = ds[0]
        else:
            ref = next(t for t in ds if t is not None)
            d = torch.cat(
                [t if t is not None else ref.new_zeros(*ref.shape[:-1], w) for t, (_l, w) in zip(ds, parts)], dim=-1
            )
        if d.shape[-1] != y.shape[-1]:
            d = _gather_like_base(_mod, d, parts, y.shape[-1])
        y = add_delta(y, d)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    return hook


def _gather_like_base(mod, d: torch.Tensor, parts, width: int) -> torch.Tensor:
    """The base returned its column shards already gathered (``KimiMLA.linear_kv_down_proj`` at
    TP > 1 gathers inside its forward, with a backward that sums the shared rope key's gradient):
    send the local delta through the same gather, so it gets exactly the base output's gradient."""
    from kimi_megatron_plugin.models.layers import GatherKVLatent

    lin = parts[0][0]
    if (
        len(parts) != 1
        or lin.kind != "col"
        or width != lin.out_features
        or not lin.module.endswith("kv_a_proj_with_mqa")
    ):
        raise LoraApplyError(
            f"{lin.module if lin is not None else mod}: base output width {width} fits neither "
            f"the local LoRA delta ({d.shape[-1]}) nor a known gathered output"
        )
    return GatherKVLatent.apply(d, mod.config.kv_lora_rank, lin.tp_group)


def apply_lora(model, spec: LoraSpec, seed: int = 0, freeze_base: bool = True) -> KimiLora:
    """Attach LoRA for ``spec`` to ``model`` (this rank's ``GPTModel`` chunk, any TP/EP/PP layout).

    :param seed: initialisation seed (``A ~ N(0, 1/in)`` per module, ``B = 0``).
    :param freeze_base: set ``requires_grad=False`` on every base parameter.
    :returns: the :class:`KimiLora` holding this rank's factors.
    """
    model = unwrap_model(model)
    kimi = model.kimi_config
    groups = list(iter_target_groups(kimi, spec))
    bad = [g.module for g in groups if g.kind == "indexer"]
    if bad:
        raise LoraApplyError(
            f"LoraSpec.target_modules selects the DSA indexer ({bad[0]}); the indexer runs "
            "frozen under no_grad in kimi_megatron_plugin, so its LoRA could not train"
        )
    dense = {g.module: g for g in groups if g.kind != "expert"}
    expert_groups = {(g.moe, g.proj): g for g in groups if g.kind == "expert"}
    lora = KimiLora(kimi, spec)
    par = lora.par
    device = next(model.parameters()).device
    r_e = spec.expert_rank(kimi.num_experts_per_tok)
    s_dense = spec.scaling(spec.rank, float(spec.alpha))
    s_exp = spec.scaling(r_e, spec.expert_alpha_value())
    found: set[str] = set()
    for name, mod in model.named_modules():
        if name.startswith("decoder.layers.") and name.count(".") >= 2:
            local = int(name.split(".")[2])
            layer = model.decoder.layers[local].layer_number - 1
        else:
            layer = None
        if isinstance(mod, KimiExperts):
            moe = moe_module(kimi, layer)
            targeted = [p for p, hf in zip(PROJ, kimi.expert_names) if (moe, hf) in expert_groups]
            if not targeted:
                continue
            le = LoraExperts(
                moe,
                kimi.expert_names,
                mod.shapes,
                mod.E,
                kimi.n_routed_experts,
                par["ep_rank"] * mod.E,
                r_e,
                s_exp,
                spec.expert_layout,
                targeted,
                device=device,
            )
            for p in targeted:
                hf = dict(zip(PROJ, kimi.expert_names))[p]
                found.add(f"{moe}.experts.{{e}}.{hf}")
                (out, inp) = mod.shapes[p]
                A, B = le.factors(p)
                shared_a = le.shared[p][0]
                with torch.no_grad():
                    for i in range(A.shape[0]):
                        nm = f"{moe}.experts.{hf}" if shared_a else f"{moe}.experts.{le.offset + i}.{hf}"
                        A[i].copy_(_randn_A(seed, nm, r_e, inp))
            lora.experts[_key(moe)] = le
            mod.lora_delta = le.delta
            lora._expert_modules.append(mod)
            continue
        w = mod._parameters.get("weight")
        if w is None or w.ndim != 2:
            continue
        hit = mapping.match(f"{name}.weight")
        if hit is None or hit[0].split == "expert":
            continue
        rule, m, _local = hit
        hfs = [h[: -len(".weight")] for h in mapping.hf_names(rule, m, kimi, layer) if h.endswith(".weight")]
        if not any(h in dense for h in hfs):
            continue
        o_loc, i_loc = w.shape
        parts = []
        for h in hfs:
            width = o_loc // len(hfs)
            g = dense.get(h)
            if g is None:
                parts.append((None, width))
                continue
            if width < g.out_features:
                kind = "col"
            elif i_loc < g.in_features:
                kind = "row"
            else:
                kind = "rep"
            lin = LoraLinear(
                h,
                g.in_features,
                g.out_features,
                spec.rank,
                s_dense,
                kind,
                par["tp_group"],
                par["tp_rank"],
                par["tp"],
                device=device,
            )
            lin.set_full(_randn_A(seed, h, spec.rank, g.in_features), torch.zeros(g.out_features, spec.rank))
            got = (lin.B.shape[0], lin.A.shape[1])
            if got != (width, i_loc):
                raise LoraApplyError(
                    f"{h}: megatron {name}.weight is {tuple(w.shape)} on this rank, LoRA pieces "
                    f"would be [{got[0]}, {got[1]}] (kind {kind}); mapping and module disagree"
                )
            lora.dense[_key(h)] = lin
            parts.append((lin, width))
            found.add(h)
        lora._handles.append(mod.register_forward_hook(_dense_hook(parts)))
    # every selected target of this stage's layers must have found its module
    layers = {layer.layer_number - 1 for layer in model.decoder.layers}
    missing = [g.module for g in groups if g.layer in layers and g.module not in found]
    if missing:
        lora.remove()
        raise LoraApplyError(
            f"LoRA targets without a megatron module on this rank: {missing[:4]} "
            f"({len(missing)} in all); kimi_megatron_plugin.mapping has no rule for them"
        )
    if freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    # a plain attribute (not a submodule): the model's state dict, and so the HF mapping, stay unchanged
    object.__setattr__(model, "kimi_lora", lora)
    return lora
