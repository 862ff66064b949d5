"""HF / PEFT names and shapes of every LoRA target of Kimi K2.x, K3 and K3.1.

Module names are the HF ones (``docs/models.md``), with the family's
``config.lm_prefix`` (``language_model.`` for K2.5 / K3 / K3.1, nothing for K2 text):

===================  =========================================================  ======================
where                modules (``<prefix>model.layers.{l}.``)                     ``[out, in]``
===================  =========================================================  ======================
MLA (K2 all; K3      ``self_attn.q_a_proj``, ``q_b_proj`` (or ``q_proj`` when     ``[q_lora, H]``,
full_attn_layers)    ``q_lora_rank`` is null), ``kv_a_proj_with_mqa``,          ``[n·(nope+rope), q_lora]``,
                     ``kv_b_proj``, ``o_proj``; K3 ``g_proj`` (output gate)     ``[kv_lora+rope, H]``,
                                                                                ``[n·(nope+v), kv_lora]``,
                                                                                ``[H, n·v]``, ``[n·v, H]``
DSA indexer (K3.1)   ``self_attn.indexer.{wq_b, wk, weights_proj}`` (names [I])  opt-in only
KDA (K3 kda_layers)  ``self_attn.{q,k,v}_proj`` ``[P, H]``, ``f_a_proj`` ``[d, H]``, ``f_b_proj`` ``[P, d]``,
                     ``b_proj`` ``[heads, H]``, ``g_proj`` ``[P, H]`` (or ``g_a_proj``/``g_b_proj``), ``o_proj`` ``[H, P]``
dense MLP            ``mlp.{gate,up}_proj`` ``[inter, H]``, ``mlp.down_proj`` ``[H, inter]``
shared experts       ``<moe>.shared_experts.{gate,up,down}_proj`` (width ``moe_inter · n_shared``)
K3 latent            ``block_sparse_moe.routed_expert_down_proj`` ``[latent, H]``, ``routed_expert_up_proj`` ``[H, latent]``
routed experts       K2: ``mlp.experts.{e}.{gate,up,down}_proj``; K3: ``block_sparse_moe.experts.{e}.{w1,w3,w2}``
===================  =========================================================  ======================

``<moe>`` is ``mlp`` (K2.x) or ``block_sparse_moe`` (K3). In PEFT files every module name gets
``base_model.model.`` in front and ``.lora_A.weight`` (``[r, in]``) / ``.lora_B.weight``
(``[out, r]``) behind.

Selection (:func:`is_selected`) follows PEFT: a list entry matches a module whose name equals it
or ends with ``"." + entry``; a string is a regex that must match the whole name;
``"all-linear"`` selects every module above except the DSA indexer. Routed experts are selected
per (layer, projection), by testing the name of expert 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kimi_core.lora.config import ALL_LINEAR, LoraSpec

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = [
    "PEFT_PREFIX",
    "MEGATRON_TO_HF",
    "hf_leaves",
    "target_names",
    "Target",
    "TargetGroup",
    "dense_targets",
    "all_dense_targets",
    "expert_shapes",
    "moe_module",
    "moe_modules",
    "is_selected",
    "iter_target_groups",
    "iter_targets",
    "target_shapes",
    "selected_leaves",
    "lora_names",
    "expert_pattern_keys",
    "ParsedName",
    "parse_lora_name",
    "normalize_module",
    "canonical_proj",
]

PEFT_PREFIX = "base_model.model."
_INDEXER_LEAVES = ("wq_b", "wk", "weights_proj")


@dataclass(frozen=True)
class Target:
    """One LoRA target module. ``in_features``/``out_features`` of its weight ``[out, in]``."""

    module: str
    in_features: int
    out_features: int
    rank: int
    kind: str  # mla | indexer | kda | mlp | shared_expert | latent | expert
    layer: int
    expert: int | None = None
    proj: str | None = None

    @property
    def is_expert(self) -> bool:
        return self.kind == "expert"


@dataclass(frozen=True)
class TargetGroup:
    """Targets that share a shape: one dense module (``count == 1``) or one (layer, projection)
    of routed experts (``count == num_experts``; ``module`` is ``<moe>.experts.{e}.<proj>`` with
    a literal ``{e}``)."""

    module: str
    in_features: int
    out_features: int
    rank: int
    kind: str
    layer: int
    count: int = 1
    moe: str | None = None
    proj: str | None = None


# ---------------------------------------------------------------------------------------- shapes
def _attention(config: KimiConfig, layer: int) -> dict[str, tuple[int, int, str]]:
    """``{local name: (in, out, kind)}`` of the attention block of ``layer``."""
    H = config.hidden_size
    out: dict[str, tuple[int, int, str]] = {}
    if config.is_kda_layer(layer):
        la = config.linear_attn
        d, n = la.head_dim, la.num_heads
        P = n * d
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"self_attn.{name}"] = (H, P, "kda")
        out["self_attn.f_a_proj"] = (H, d, "kda")
        out["self_attn.f_b_proj"] = (d, P, "kda")
        out["self_attn.b_proj"] = (H, n, "kda")
        if la.use_full_rank_gate:
            out["self_attn.g_proj"] = (H, P, "kda")
        else:
            out["self_attn.g_a_proj"] = (H, d, "kda")
            out["self_attn.g_b_proj"] = (d, P, "kda")
        out["self_attn.o_proj"] = (P, H, "kda")
        return out
    n = config.num_attention_heads
    if config.q_lora_rank:
        out["self_attn.q_a_proj"] = (H, config.q_lora_rank, "mla")
        out["self_attn.q_b_proj"] = (config.q_lora_rank, n * config.qk_head_dim, "mla")
    else:
        out["self_attn.q_proj"] = (H, n * config.qk_head_dim, "mla")
    out["self_attn.kv_a_proj_with_mqa"] = (H, config.kv_lora_rank + config.qk_rope_head_dim, "mla")
    out["self_attn.kv_b_proj"] = (config.kv_lora_rank, n * (config.qk_nope_head_dim + config.v_head_dim), "mla")
    if config.mla_use_output_gate:
        out["self_attn.g_proj"] = (H, n * config.v_head_dim, "mla")
    out["self_attn.o_proj"] = (n * config.v_head_dim, H, "mla")
    if config.has_indexer:
        nh, hd = config.index_n_heads, config.index_head_dim
        out["self_attn.indexer.wq_b"] = (config.q_lora_rank, nh * hd, "indexer")
        out["self_attn.indexer.wk"] = (H, hd, "indexer")
        out["self_attn.indexer.weights_proj"] = (H, nh, "indexer")
    return out


def _mlp(config: KimiConfig, layer: int) -> dict[str, tuple[int, int, str]]:
    """``{local name: (in, out, kind)}`` of the non-routed MLP parts of ``layer``."""
    H = config.hidden_size
    out: dict[str, tuple[int, int, str]] = {}
    if not config.is_moe_layer(layer):
        inter = config.intermediate_size
        out["mlp.gate_proj"] = (H, inter, "mlp")
        out["mlp.up_proj"] = (H, inter, "mlp")
        out["mlp.down_proj"] = (inter, H, "mlp")
        return out
    moe = config.moe_prefix
    if config.n_shared_experts:
        inter = config.moe_intermediate_size * config.n_shared_experts
        out[f"{moe}.shared_experts.gate_proj"] = (H, inter, "shared_expert")
        out[f"{moe}.shared_experts.up_proj"] = (H, inter, "shared_expert")
        out[f"{moe}.shared_experts.down_proj"] = (inter, H, "shared_expert")
    if config.is_k3_family and config.routed_expert_hidden_size:
        lat = config.routed_expert_hidden_size
        out[f"{moe}.routed_expert_down_proj"] = (H, lat, "latent")
        out[f"{moe}.routed_expert_up_proj"] = (lat, H, "latent")
    return out


def dense_targets(config: KimiConfig, layer: int) -> dict[str, tuple[int, int, str]]:
    """Every non-expert LoRA-able module of ``layer``: ``{full HF module name: (in, out, kind)}``."""
    pre = config.layer_prefix(layer)
    return {pre + k: v for k, v in {**_attention(config, layer), **_mlp(config, layer)}.items()}


def all_dense_targets(config: KimiConfig) -> dict[str, tuple[int, int, str]]:
    """:func:`dense_targets` of every layer."""
    out: dict[str, tuple[int, int, str]] = {}
    for layer in range(config.num_hidden_layers):
        out.update(dense_targets(config, layer))
    return out


def expert_shapes(config: KimiConfig) -> dict[str, tuple[int, int]]:
    """``{HF expert projection: (in, out)}``: gate/up read the expert width (latent on K3)."""
    g, u, d = config.expert_names
    w, inter = config.expert_in_size, config.moe_intermediate_size
    return {g: (w, inter), u: (w, inter), d: (inter, w)}


def moe_module(config: KimiConfig, layer: int) -> str:
    """Full HF name of the MoE block of ``layer`` (``...layers.{l}.mlp`` / ``.block_sparse_moe``)."""
    return f"{config.layer_prefix(layer)}{config.moe_prefix}"


def moe_modules(config: KimiConfig) -> dict[str, int]:
    """``{moe module name: layer}`` of every MoE layer."""
    return {moe_module(config, layer): layer for layer in range(config.num_hidden_layers) if config.is_moe_layer(layer)}


_GATE_UP_DOWN = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


def canonical_proj(config: KimiConfig, proj: str) -> str:
    """Map an expert projection name of either family (``gate_proj``/``w1``...) to ``config``'s."""
    if proj in config.expert_names:
        return proj
    if proj not in _GATE_UP_DOWN:
        raise KeyError(f"unknown expert projection {proj!r}; expected one of {config.expert_names}")
    return config.expert_names[_GATE_UP_DOWN[proj]]


# ---------------------------------------------------------------------------------------- selection
def _matches(patterns, module: str) -> bool:
    if isinstance(patterns, str):
        if patterns == ALL_LINEAR:
            return True
        return re.fullmatch(patterns, module) is not None
    return any(module == p or module.endswith("." + p) for p in patterns)


def is_selected(spec: LoraSpec, module: str, kind: str) -> bool:
    """PEFT target/exclude rule for one module (``kind`` keeps the indexer out of ``all-linear``)."""
    tm = spec.target_modules
    if tm == ALL_LINEAR:
        if kind == "indexer":
            return False
    elif not _matches(tm, module):
        return False
    ex = spec.exclude_modules
    if ex and _matches(ex, module):
        return False
    return True


def iter_target_groups(config: KimiConfig, spec: LoraSpec | None = None) -> Iterator[TargetGroup]:
    """Every selected target, experts grouped per (layer, projection). ``spec=None`` selects all
    LoRA-able modules (indexer included) at rank 1 (used for validation)."""
    r = spec.rank if spec else 1
    r_e = spec.expert_rank(config.num_experts_per_tok) if spec else 1
    shapes = expert_shapes(config)
    for layer in range(config.num_hidden_layers):
        for name, (fin, fout, kind) in dense_targets(config, layer).items():
            if spec is None or is_selected(spec, name, kind):
                yield TargetGroup(name, fin, fout, r, kind, layer)
        if not config.is_moe_layer(layer):
            continue
        moe = moe_module(config, layer)
        for proj, (fin, fout) in shapes.items():
            if spec is None or is_selected(spec, f"{moe}.experts.0.{proj}", "expert"):
                yield TargetGroup(
                    f"{moe}.experts.{{e}}.{proj}",
                    fin,
                    fout,
                    r_e,
                    "expert",
                    layer,
                    count=config.n_routed_experts,
                    moe=moe,
                    proj=proj,
                )


def iter_targets(config: KimiConfig, spec: LoraSpec) -> Iterator[Target]:
    """Every selected target, one per expert (K3 real config: ~250k entries)."""
    for g in iter_target_groups(config, spec):
        if g.kind != "expert":
            yield Target(g.module, g.in_features, g.out_features, g.rank, g.kind, g.layer)
            continue
        for e in range(g.count):
            yield Target(
                f"{g.moe}.experts.{e}.{g.proj}",
                g.in_features,
                g.out_features,
                g.rank,
                "expert",
                g.layer,
                expert=e,
                proj=g.proj,
            )


def target_shapes(config: KimiConfig, spec: LoraSpec) -> dict[str, tuple[int, int, int, bool]]:
    """``{HF module name: (in, out, rank, is_expert)}`` for every target ``spec`` selects on ``config``.

    ``lora_A`` of a module is ``[rank, in]`` and ``lora_B`` is ``[out, rank]``.
    """
    return {t.module: (t.in_features, t.out_features, t.rank, t.is_expert) for t in iter_targets(config, spec)}


def selected_leaves(config: KimiConfig, spec: LoraSpec) -> set[str]:
    """Last name components of the selected modules: PEFT's ``target_modules`` list."""
    return {g.module.rsplit(".", 1)[-1] for g in iter_target_groups(config, spec)}


def lora_names(module: str, peft_prefix: bool = True) -> tuple[str, str]:
    """``(lora_A name, lora_B name)`` of ``module`` as stored in ``adapter_model.safetensors``."""
    pre = PEFT_PREFIX if peft_prefix else ""
    return f"{pre}{module}.lora_A.weight", f"{pre}{module}.lora_B.weight"


def expert_pattern_keys(config: KimiConfig, layout: str) -> dict[str, str]:
    """``{projection: rank_pattern key}`` matching routed experts (only) in file ``layout``.

    ``stacked`` has two projections, ``gate_up_proj`` and ``down_proj``, as vLLM names them when
    it matches patterns (``experts.base_layer`` -> ``experts.gate_up_proj``).
    """
    if layout == "stacked":
        return {"gate_up_proj": r"experts\.gate_up_proj", "down_proj": r"experts\.down_proj"}
    mid = r"\.\d+\." if layout == "per_expert" else r"\."
    return {p: rf"experts{mid}{p}" for p in config.expert_names}


# ---------------------------------------------------------------------------------------- parsing
_LORA_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_EXPERT_RE = re.compile(r"^(?P<moe>.+)\.experts(?:\.(?P<rest>.+))?$")


@dataclass(frozen=True)
class ParsedName:
    """A ``.lora_A/.lora_B`` tensor name, classified.

    ``form``: ``dense`` | ``per_expert`` (``experts.{e}.<proj>``, 2-D) | ``expert_3d``
    (``experts.<proj>``, 3-D ``[E or 1, ...]``) | ``stacked`` (``experts.base_layer`` = gate_up,
    ``experts`` = down; 2-D with experts folded into the rank).
    """

    name: str
    module: str  # normalised full HF module name (no PEFT prefix)
    ab: str  # "A" | "B"
    form: str
    moe: str | None = None
    expert: int | None = None
    proj: str | None = None  # HF projection, or "gate_up_proj"/"down_proj" for stacked


def normalize_module(config: KimiConfig, module: str) -> str:
    """Strip ``base_model.model.``; add or drop ``language_model.`` to match ``config.lm_prefix``."""
    if module.startswith(PEFT_PREFIX):
        module = module[len(PEFT_PREFIX) :]
    pre = config.lm_prefix
    if pre and module.startswith("model.layers."):
        module = pre + module
    elif not pre and module.startswith("language_model.model.layers."):
        module = module[len("language_model.") :]
    return module


def parse_lora_name(config: KimiConfig, name: str) -> ParsedName | None:
    """Classify one tensor name; ``None`` if it is not a ``lora_A``/``lora_B`` weight name."""
    m = _LORA_RE.match(name)
    if not m:
        return None
    module = normalize_module(config, m.group("module"))
    ab = m.group("ab")
    em = _EXPERT_RE.match(module)
    if em and not em.group("moe").endswith("shared"):
        moe, rest = em.group("moe"), em.group("rest")
        if rest is None:
            return ParsedName(name, module, ab, "stacked", moe, None, "down_proj")
        if rest == "base_layer":
            return ParsedName(name, module, ab, "stacked", moe, None, "gate_up_proj")
        parts = rest.split(".")
        if len(parts) == 2 and parts[0].isdigit():
            return ParsedName(name, module, ab, "per_expert", moe, int(parts[0]), parts[1])
        if len(parts) == 1:
            return ParsedName(name, module, ab, "expert_3d", moe, None, parts[0])
    return ParsedName(name, module, ab, "dense")


#: Megatron leaf -> HF leaves (the names host trainers on Megatron use for LoRA targets)
MEGATRON_TO_HF = {
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_q_proj": ("q_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
# the expert projections of the two families: K2.x gate / up / down, K3 w1 / w3 / w2
_FAMILY_ALIASES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_FAMILY_ALIASES.update({v: k for k, v in _FAMILY_ALIASES.items()})


def target_names(value) -> list[str]:
    """A host's LoRA target flag as a list of names: ``None`` -> ``[]``, a comma-separated string split, any other
    iterable taken item by item (each stripped, empty items dropped)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else value
    return [s for s in (str(v).strip() for v in items) if s]


def hf_leaves(names) -> tuple[str, ...]:
    """HF leaves for a host's LoRA target names, in order, without repeats.

    Megatron leaves expand (``linear_fc1`` -> ``gate_proj``, ``w1``, ``up_proj``, ``w3``), HF leaves gain the
    other family's alias (``down_proj`` <-> ``w2``), anything else passes through unchanged.
    """
    out: list[str] = []
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        for hf in MEGATRON_TO_HF.get(leaf, (n,)):
            for x in (hf, _FAMILY_ALIASES.get(hf)):
                if x and x not in out:
                    out.append(x)
    return tuple(out)
