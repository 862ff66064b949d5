"""Expert layouts of a Kimi LoRA adapter and exact conversions between them.

Four file forms hold routed-expert factors (non-expert modules are the same in all of them:
``<module>.lora_A.weight [r, in]``, ``<module>.lora_B.weight [out, r]``):

``per_expert``
    2-D per expert, ``<moe>.experts.{e}.<proj>.lora_A.weight [r, in]`` / ``lora_B [out, r]``
    (vLLM ``is_3d_moe_weight=False``, PEFT on the HF model, SGLang numbered experts).
``per_expert_3d``
    one 3-D tensor per projection, ``<moe>.experts.<proj>.lora_A.weight [E, r, in]`` /
    ``lora_B [E, out, r]`` (SGLang's grouped form).
``shared_outer``
    SGLang ``--experts-shared-outer-loras`` (sgl-project/sglang PR #21466, #25141; Megatron-Bridge
    ``experts_shared_outer_loras``; miles K3 LoRA): the same 3-D names, but gate and up ``lora_A``
    are ``[1, r, in]`` (one A per layer, shared by all experts; per-expert ``lora_B [E, out, r]``)
    and down is the inverse: per-expert ``lora_A [E, r, inter]``, shared ``lora_B [1, out, r]``.
    Source: sglang ``srt/lora/lora.py`` (``_rename_expert_w_to_proj`` maps ``w1/w3/w2`` to
    ``gate_proj/up_proj/down_proj``; ``normalize_gate_up_proj`` concatenates gate and up along
    dim ``ndim-2``, giving the pool's ``gate_up`` A ``(1, 2r, H)``) and ``lora_manager.py``
    (``_detect_shared_outer_loras``: a 3-D gate_up ``lora_A`` with ``shape[0] == 1`` means
    shared outer, ``shape[0] == E`` per-expert).
``stacked``
    vLLM's PEFT ``target_parameters`` form (vllm-project/vllm ``vllm/lora/model_manager.py``
    ``_stack_moe_lora_weights``; NovaSky-AI/SkyRL ``_convert_moe_experts_lora_to_vllm``):
    ``<moe>.experts.base_layer`` = gate_up and ``<moe>.experts`` = down, experts folded into the
    rank: ``lora_A [E*r, in]`` expert-major (row ``e*r + j``), ``lora_B [out, r*E]``
    expert-minor (column ``j*E + e``). gate_up ``lora_B`` rows are gate ``[0, I)`` then up
    ``[I, 2I)`` (interleaving is GPT-OSS only). gate and up share one A here; when the per-expert
    adapter has different gate and up A, the exact stacked form has rank ``r_gate + r_up`` with
    block-diagonal ``lora_B`` and ``rank_pattern``/``alpha_pattern`` entries that keep the scaling.

Inside this module, experts of one (MoE block, projection) are held as ``A [n, r, in]`` and
``B [n, out, r]`` where ``n`` is the number of experts or 1 (a factor shared by all experts).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kimi_core.lora.adapter import Adapter, AdapterError
from kimi_core.lora.config import FILE_LAYOUTS, META_KEY, module_rank_alpha
from kimi_core.lora.naming import (
    PEFT_PREFIX,
    all_dense_targets,
    canonical_proj,
    expert_pattern_keys,
    expert_shapes,
    moe_modules,
    parse_lora_name,
)

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = ["Decomposed", "decompose", "compose", "convert_layout", "detect_layout", "expert_module_for_patterns"]


@dataclass
class Decomposed:
    """An adapter split into dense pairs and per-(MoE block, projection) expert stacks.

    :param dense: ``{module: (A [r, in], B [out, r])}``.
    :param experts: ``{(moe, proj): (A [n, r, in], B [n, out, r])}``, ``n`` = experts in
        ``expert_range`` or 1 (shared); gate and up may hold the same ``A`` object (stacked form).
    :param rank_alpha: ``{module or (moe, proj): (r, alpha)}`` from the adapter config.
    :param forms: ``{moe: file form}`` as found (``per_expert``/``expert_3d``/``stacked``).
    :param names: ``{module or (moe, proj): tensor name of A}`` for error messages.
    """

    dense: dict = field(default_factory=dict)
    experts: dict = field(default_factory=dict)
    rank_alpha: dict = field(default_factory=dict)
    forms: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)
    expert_range: tuple[int, int] = (0, 0)


def expert_module_for_patterns(moe: str, proj: str, form: str) -> str:
    """The module name PEFT / vLLM match ``rank_pattern`` keys against for this expert group."""
    if form == "per_expert":
        return f"{moe}.experts.0.{proj}"
    if form == "stacked":
        return f"{moe}.experts.{proj}"  # proj is gate_up_proj / down_proj here
    return f"{moe}.experts.{proj}"


def _err(where: str, name: str, msg: str) -> AdapterError:
    return AdapterError(f"{where}: tensor {name!r}: {msg}")


def decompose(
    tensors: dict,
    config: KimiConfig,
    adapter_config: dict | None = None,
    where: str = "adapter",
    expert_range: tuple[int, int] | None = None,
    max_rank: int | None = None,
) -> Decomposed:
    """Parse and validate ``tensors`` (any layout) against ``config``.

    Raises :class:`AdapterError` naming ``where`` and the tensor for: a name that is not a LoRA
    weight, an unknown module (not a LoRA target of this model), an expert index out of range,
    a wrong rank/shape/ndim, ``lora_A`` without ``lora_B`` (or the reverse), mixed forms in
    one MoE block, a rank above ``max_rank``, and (with ``adapter_config``) a tensor rank that
    disagrees with ``r``/``rank_pattern``.
    """
    E = config.n_routed_experts
    lo, hi = expert_range if expert_range is not None else (0, E)
    if not 0 <= lo < hi <= E:
        raise AdapterError(f"{where}: expert_range {(lo, hi)} is not inside [0, {E})")
    n = hi - lo
    dense_ok = all_dense_targets(config)
    moes = moe_modules(config)
    eshapes = expert_shapes(config)
    g, u, d = config.expert_names
    out = Decomposed(expert_range=(lo, hi))
    pairs: dict = {}  # key -> {"A": (name, t), "B": (name, t)}
    per_expert: dict = {}  # (moe, proj) -> {e: {"A":..., "B":...}}
    for name, t in tensors.items():
        p = parse_lora_name(config, name)
        if p is None:
            raise _err(where, name, "not a LoRA weight (expected '<module>.lora_A.weight' or '.lora_B.weight')")
        if p.form == "dense":
            if p.module not in dense_ok:
                raise _err(
                    where,
                    name,
                    f"module {p.module!r} is not a LoRA target of this {config.architecture} config (unknown module)",
                )
            pairs.setdefault(p.module, {})[p.ab] = (name, t)
            continue
        if p.moe not in moes:
            raise _err(
                where,
                name,
                f"{p.moe!r} is not a MoE block of this {config.architecture} config "
                f"(unknown module; MoE blocks look like {next(iter(moes), '-')!r})",
            )
        prev = out.forms.setdefault(p.moe, p.form)
        if prev != p.form:
            raise _err(where, name, f"MoE block {p.moe!r} mixes expert forms {prev!r} and {p.form!r}")
        if p.form == "stacked":
            pairs.setdefault((p.moe, p.proj), {})[p.ab] = (name, t)
            continue
        try:
            proj = canonical_proj(config, p.proj)
        except KeyError:
            raise _err(
                where,
                name,
                f"unknown expert projection {p.proj!r} (unknown module); expected one of {config.expert_names}",
            ) from None
        if p.proj != proj:
            raise _err(where, name, f"expert projection {p.proj!r} is not this family's name {proj!r}")
        if p.form == "expert_3d":
            pairs.setdefault((p.moe, proj), {})[p.ab] = (name, t)
        else:
            if not lo <= p.expert < hi:
                raise _err(where, name, f"expert {p.expert} outside [{lo}, {hi}) (model has {E} experts)")
            per_expert.setdefault((p.moe, proj), {}).setdefault(p.expert, {})[p.ab] = (name, t)

    def need_pair(key: str, pr):
        for ab, other in (("A", "B"), ("B", "A")):
            if ab in pr and other not in pr:
                raise _err(where, pr[ab][0], f"lora_{ab} without lora_{other}")

    def check_rank(key: str, name: str, r: int, module_for_patterns):
        if max_rank is not None and r > max_rank:
            raise _err(where, name, f"rank {r} > max_rank {max_rank} (the engine's max_lora_rank)")
        if r <= 0:
            raise _err(where, name, "rank 0")
        if adapter_config is not None:
            r_cfg, alpha = module_rank_alpha(adapter_config, module_for_patterns)
            if r_cfg != r:
                raise _err(
                    where,
                    name,
                    f"rank {r} but adapter_config gives r={r_cfg} for {module_for_patterns!r} "
                    f"(r / rank_pattern); the scaling alpha/r would be wrong",
                )
            out.rank_alpha[key] = (r, alpha)

    def check_finite(name: str, t):
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).sum().item()
            kind = "NaN" if torch.isnan(t).any() else "Inf"
            raise _err(where, name, f"{bad} non-finite values ({kind})")
        if not t.is_floating_point():
            raise _err(where, name, f"dtype {t.dtype} is not a floating-point type")

    for key, pr in pairs.items():
        need_pair(key, pr)
        (na, A), (nb, B) = pr["A"], pr["B"]
        check_finite(na, A)
        check_finite(nb, B)
        if isinstance(key, str):  # dense
            fin, fout, _ = dense_ok[key]
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != fin or B.shape[0] != fout or A.shape[0] != B.shape[1]:
                raise _err(
                    where,
                    na,
                    f"shape mismatch: lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}; "
                    f"expected [r, {fin}] and [{fout}, r] for {key}",
                )
            check_rank(key, na, A.shape[0], key)
            out.dense[key] = (A, B)
            out.names[key] = na
            continue
        moe, proj = key
        if out.forms[moe] == "stacked":
            fin, fout = eshapes[g] if proj == "gate_up_proj" else eshapes[d]
            if proj == "gate_up_proj":
                fout = 2 * fout
            if (
                A.ndim != 2
                or B.ndim != 2
                or A.shape[1] != fin
                or B.shape[0] != fout
                or A.shape[0] != B.shape[1]
                or A.shape[0] % n
            ):
                raise _err(
                    where,
                    na,
                    f"shape mismatch: stacked lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}; "
                    f"expected [{n}*r, {fin}] and [{fout}, r*{n}] ({n} experts)",
                )
            r = A.shape[0] // n
            check_rank(key, na, r, expert_module_for_patterns(moe, proj, "stacked"))
            A3 = A.reshape(n, r, fin)
            B3 = B.reshape(fout, r, n).permute(2, 0, 1)
            if proj == "down_proj":
                out.experts[(moe, d)] = (A3, B3)
                out.names[(moe, d)] = na
                if key in out.rank_alpha:
                    out.rank_alpha[(moe, d)] = out.rank_alpha.pop(key)
                continue
            half = fout // 2
            Bg, Bu = B3[:, :half], B3[:, half:]
            Ag = Au = A3
            if (
                r % 2 == 0
                and not Bg[:, :, r // 2 :].any()
                and not Bu[:, :, : r // 2].any()
                and Bg[:, :, : r // 2].any()
                and Bu[:, :, r // 2 :].any()
            ):
                # block-diagonal: the exact stacked form of different gate/up A (see module doc)
                h = r // 2
                Ag, Au, Bg, Bu = A3[:, :h], A3[:, h:], Bg[:, :, :h], Bu[:, :, h:]
                if key in out.rank_alpha:
                    r_, a_ = out.rank_alpha[key]
                    out.rank_alpha[key] = (h, _alpha_for(adapter_config, r_, a_, h))
            out.experts[(moe, g)] = (Ag, Bg)
            out.experts[(moe, u)] = (Au, Bu)
            out.names[(moe, g)] = out.names[(moe, u)] = na
            if key in out.rank_alpha:
                out.rank_alpha[(moe, g)] = out.rank_alpha[(moe, u)] = out.rank_alpha.pop(key)
            continue
        # expert_3d
        fin, fout = eshapes[proj]
        if (
            A.ndim != 3
            or B.ndim != 3
            or A.shape[0] not in (1, n)
            or B.shape[0] not in (1, n)
            or A.shape[2] != fin
            or B.shape[1] != fout
            or A.shape[1] != B.shape[2]
        ):
            raise _err(
                where,
                na,
                f"shape mismatch: lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}; expected "
                f"[{n} or 1, r, {fin}] and [{n} or 1, {fout}, r]",
            )
        check_rank(key, na, A.shape[1], expert_module_for_patterns(moe, proj, "expert_3d"))
        out.experts[key] = (A, B)
        out.names[key] = na

    for key, by_e in per_expert.items():
        moe, proj = key
        fin, fout = eshapes[proj]
        missing = [e for e in range(lo, hi) if e not in by_e]
        if missing:
            ex = next(iter(by_e.values()))
            nm = (ex.get("A") or ex.get("B"))[0]
            raise _err(
                where,
                nm,
                f"{len(missing)} experts of {moe}.experts.*.{proj} have no factors "
                f"(first: expert {missing[0]}); a per-expert adapter needs every expert",
            )
        As, Bs = [], []
        for e in range(lo, hi):
            pr = by_e[e]
            need_pair(key, pr)
            (na, A), (nb, B) = pr["A"], pr["B"]
            check_finite(na, A)
            check_finite(nb, B)
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != fin or B.shape[0] != fout or A.shape[0] != B.shape[1]:
                raise _err(
                    where,
                    na,
                    f"shape mismatch: lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}; "
                    f"expected [r, {fin}] and [{fout}, r]",
                )
            if As and A.shape != As[0].shape:
                raise _err(where, na, f"rank {A.shape[0]} differs from expert {lo}'s rank {As[0].shape[0]}")
            As.append(A)
            Bs.append(B)
        check_rank(key, by_e[lo]["A"][0], As[0].shape[0], expert_module_for_patterns(moe, proj, "per_expert"))
        out.experts[key] = (torch.stack(As), torch.stack(Bs))
        out.names[key] = by_e[lo]["A"][0]
    return out


def _scaling(adapter_config, r: int, alpha: float):
    rs = bool(adapter_config and adapter_config.get("use_rslora"))
    return alpha / math.sqrt(r) if rs else alpha / r


def _alpha_for(adapter_config, r_old: int, alpha_old: float, r_new: int):
    """Alpha that gives rank ``r_new`` the scaling ``(r_old, alpha_old)`` has."""
    s = _scaling(adapter_config, r_old, alpha_old)
    rs = bool(adapter_config and adapter_config.get("use_rslora"))
    return s * (math.sqrt(r_new) if rs else r_new)


def detect_layout(dec: Decomposed) -> str | None:
    """The file layout of a decomposed adapter (``None`` when it has no expert factors)."""
    forms = set(dec.forms.values())
    if not forms:
        return None
    if len(forms) > 1:
        return "mixed"
    form = forms.pop()
    if form != "expert_3d":
        return form
    n = dec.expert_range[1] - dec.expert_range[0]
    shared = any(A.shape[0] == 1 or B.shape[0] == 1 for A, B in dec.experts.values())
    return "shared_outer" if shared and n > 1 else "per_expert_3d"


def _expand(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.expand(n, *t.shape[1:]) if t.shape[0] == 1 and n > 1 else t


def _shared(t: torch.Tensor) -> torch.Tensor | None:
    """``t[:1]`` if every row of ``t`` (dim 0) is equal, else ``None``."""
    if t.shape[0] == 1:
        return t
    return t[:1] if bool((t == t[:1]).all()) else None


def compose(dec: Decomposed, config: KimiConfig, layout: str, adapter_config: dict) -> Adapter:
    """Write ``dec`` in file ``layout``; returns a new :class:`Adapter` whose ``adapter_config``
    has expert ``rank_pattern``/``alpha_pattern`` keys for that layout (other keys are kept).

    Raises :class:`AdapterError` when the layout cannot hold the factors exactly
    (``shared_outer`` needs gate/up A and down B equal across experts).
    """
    if layout not in FILE_LAYOUTS:
        raise AdapterError(f"layout={layout!r}; expected one of {FILE_LAYOUTS}")
    lo, hi = dec.expert_range
    n = hi - lo
    g, u, d = config.expert_names
    t: dict[str, torch.Tensor] = {}
    for module, (A, B) in dec.dense.items():
        t[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A
        t[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B
    r0, a0 = int(adapter_config["r"]), float(adapter_config["lora_alpha"])
    # (pattern proj) -> set of (r, alpha) seen across layers
    want: dict[str, set] = {}

    def note(proj, r: int, alpha: float):
        want.setdefault(proj, set()).add((int(r), float(alpha)))

    def ra(key: str, r: int):
        # decomposed without an adapter config: keep the global scaling at the tensor's rank
        return dec.rank_alpha.get(key, (r, _alpha_for(adapter_config, r0, a0, r)))

    moes = sorted({moe for moe, _ in dec.experts}, key=lambda m: moe_modules(config).get(m, 0))
    for moe in moes:
        for proj in (g, u, d):
            if (moe, proj) not in dec.experts:
                continue
            A, B = dec.experts[(moe, proj)]
            r, alpha = ra((moe, proj), A.shape[-2])
            base = f"{PEFT_PREFIX}{moe}.experts"
            if layout == "per_expert":
                A2, B2 = _expand(A, n), _expand(B, n)
                for i, e in enumerate(range(lo, hi)):
                    t[f"{base}.{e}.{proj}.lora_A.weight"] = A2[i]
                    t[f"{base}.{e}.{proj}.lora_B.weight"] = B2[i]
                note(proj, r, alpha)
            elif layout == "per_expert_3d":
                t[f"{base}.{proj}.lora_A.weight"] = _expand(A, n).contiguous()
                t[f"{base}.{proj}.lora_B.weight"] = _expand(B, n).contiguous()
                note(proj, r, alpha)
            elif layout == "shared_outer":
                if proj in (g, u):
                    As = _shared(A)
                    if As is None:
                        raise AdapterError(
                            f"{dec.names.get((moe, proj), moe)}: lora_A of {moe}.experts.*.{proj} "
                            "differs between experts; the shared-outer layout needs one shared A"
                        )
                    A, B = As, _expand(B, n)
                else:
                    Bs = _shared(B)
                    if Bs is None:
                        raise AdapterError(
                            f"{dec.names.get((moe, proj), moe)}: lora_B of {moe}.experts.*.{proj} "
                            "differs between experts; the shared-outer layout needs one shared B"
                        )
                    A, B = _expand(A, n), Bs
                t[f"{base}.{proj}.lora_A.weight"] = A.contiguous()
                t[f"{base}.{proj}.lora_B.weight"] = B.contiguous()
                note(proj, r, alpha)
        if layout != "stacked":
            continue
        base = f"{PEFT_PREFIX}{moe}.experts"
        if (moe, d) in dec.experts:
            A, B = dec.experts[(moe, d)]
            A, B = _expand(A, n), _expand(B, n)
            r, alpha = ra((moe, d), A.shape[1])
            t[f"{base}.lora_A.weight"] = A.reshape(n * r, A.shape[2]).contiguous()
            t[f"{base}.lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], r * n).contiguous()
            note("down_proj", r, alpha)
        if (moe, g) in dec.experts or (moe, u) in dec.experts:
            if (moe, g) not in dec.experts or (moe, u) not in dec.experts:
                raise AdapterError(f"{moe}: the stacked layout needs both {g} and {u} expert factors")
            Ag, Bg = dec.experts[(moe, g)]
            Au, Bu = dec.experts[(moe, u)]
            rg, ag = ra((moe, g), Ag.shape[1])
            ru, au = ra((moe, u), Au.shape[1])
            sg, su = _scaling(adapter_config, rg, ag), _scaling(adapter_config, ru, au)
            Ag, Bg, Au, Bu = _expand(Ag, n), _expand(Bg, n), _expand(Au, n), _expand(Bu, n)
            if su != sg:
                Bu = Bu * (su / sg)  # one scaling per stacked module: fold the ratio into up's B
            if Ag.shape == Au.shape and (Ag is Au or torch.equal(Ag, Au)):
                A3, B3, r = Ag, torch.cat([Bg, Bu], dim=1), rg
            else:
                r = rg + ru
                A3 = torch.cat([Ag, Au], dim=1)
                B3 = torch.zeros(n, Bg.shape[1] + Bu.shape[1], r, dtype=Bg.dtype)
                B3[:, : Bg.shape[1], :rg] = Bg
                B3[:, Bg.shape[1] :, rg:] = Bu
            t[f"{base}.base_layer.lora_A.weight"] = A3.reshape(n * r, A3.shape[2]).contiguous()
            t[f"{base}.base_layer.lora_B.weight"] = B3.permute(1, 2, 0).reshape(B3.shape[1], r * n).contiguous()
            note("gate_up_proj", r, _alpha_for(adapter_config, rg, ag, r))

    cfg = copy.deepcopy(adapter_config)
    ours = set()
    for lay in FILE_LAYOUTS:
        ours |= set(expert_pattern_keys(config, lay).values())
    keys = expert_pattern_keys(config, layout)
    rp, ap = {}, {}
    for proj, vals in want.items():
        if len(vals) > 1:
            raise AdapterError(
                f"expert projection {proj}: different (rank, alpha) across layers {sorted(vals)}; "
                "rank_pattern keys are per projection"
            )
        r, alpha = vals.pop()
        if r != r0 or alpha != a0:
            rp[keys[proj]] = r
            ap[keys[proj]] = alpha
    for k, v in (adapter_config.get("rank_pattern") or {}).items():
        if k not in ours:
            rp.setdefault(k, v)
    for k, v in (adapter_config.get("alpha_pattern") or {}).items():
        if k not in ours:
            ap.setdefault(k, v)
    cfg["rank_pattern"], cfg["alpha_pattern"] = rp, ap
    leaves = set(cfg.get("target_modules") or []) if isinstance(cfg.get("target_modules"), list) else None
    if leaves is not None:
        has_e = any(moe for moe, _ in dec.experts)
        leaves -= set(config.expert_names)
        if has_e and layout != "stacked":
            leaves |= {p for _, p in dec.experts}
        cfg["target_modules"] = sorted(leaves)
    if layout == "stacked" and dec.experts:
        cfg["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    else:
        cfg.pop("target_parameters", None)
    meta = dict(cfg.get(META_KEY) or {})
    meta["file_layout"] = layout
    if (lo, hi) != (0, config.n_routed_experts):
        meta["expert_range"] = [lo, hi]
    cfg[META_KEY] = meta
    return Adapter(t, cfg)


def convert_layout(adapter: Adapter, config: KimiConfig, layout: str) -> Adapter:
    """``adapter`` (any layout) rewritten in ``layout``; the LoRA delta of every module and every
    expert is unchanged (bit-exact factors, except that ``stacked`` folds experts into the rank).

    Possible: any layout -> ``per_expert``/``per_expert_3d``/``stacked``; -> ``shared_outer``
    only when gate/up ``lora_A`` and down ``lora_B`` are the same for every expert.
    """
    rng = (adapter.adapter_config.get(META_KEY) or {}).get("expert_range")
    dec = decompose(
        adapter.tensors, config, adapter.adapter_config, where=adapter.source, expert_range=tuple(rng) if rng else None
    )
    out = compose(dec, config, layout, adapter.adapter_config)
    out.source = adapter.source
    return out
