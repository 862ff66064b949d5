"""The one HF <-> SGLang name table of the plugin (SGLang 0.5.17 and 0.5.23, ``KimiK3ForConditionalGeneration``
and our K3.1 subclass; ``DeepseekV3ForCausalLM`` for K2.x).

Checkpoint tensors: SGLang fuses some HF modules into one parameter at load time
(``KimiK3LinearForCausalLM.load_weights``); :data:`PARAM_RULES` says which, as data. Each row is
``(HF suffix, SGLang suffix, shard, where)``: a tensor whose name ends with the HF suffix
(``{e}`` = expert id) loads into the SGLang parameter with that suffix, as shard ``shard`` of it
(``None`` = whole tensor); ``where`` restricts a row to MLA (``mla``) or KDA (``kda``) layers.
Names not matched by any row keep their HF name, after :data:`RENAMES` (K3's MoE block is
``block_sparse_moe`` in HF and ``mlp`` in SGLang). SGLang parameter names are relative to the
top-level model: K3 family ``language_model.model.layers.{i}...``, K2 ``model.layers.{i}...``.

LoRA: SGLang names LoRA weights by the module that owns them after fusion (:data:`LORA_MODULES`,
its LoRA memory-pool names), but ``--lora-target-modules`` only accepts the leaf names of
``SUPPORTED_LORA_TARGET_MODULES`` (``utils/common.py``, the same list in 0.5.17 and 0.5.23), which
``lora.utils.get_normalized_target_modules`` then maps (``q_a_proj`` -> ``fused_qkv_a_proj_with_mqa``,
``wq_b`` -> ``indexer.wq_b``). Routed experts have no name of their own there: ``FusedMoEWithLoRA``
gets LoRA when both ``gate_up_proj`` and ``down_proj`` are targeted (``lora_manager.update_lora_info``).
:data:`LORA_TARGET_NAMES` is the HF leaf -> flag-value table.
"""

from __future__ import annotations

import re

__all__ = [
    "PARAM_RULES",
    "RENAMES",
    "LORA_MODULES",
    "LORA_TARGET_NAMES",
    "K3_LORA_LEAVES",
    "hf_to_sglang",
    "layer_index",
    "sglang_param_names",
    "lora_target_modules",
]

# (HF suffix, SGLang suffix, shard, where). Experts: ``weight_packed`` is renamed ``weight`` first.
PARAM_RULES: tuple[tuple[str, str, object, str], ...] = (
    # MLA: q_a_proj and kv_a_proj_with_mqa share one ReplicatedLinear (rows [0, q_lora) then the rest)
    ("self_attn.q_a_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight", "q_a", "mla"),
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight", "kv_a", "mla"),
    # KDA with K3's full-rank gate: [q, k, v, g] column-parallel, convs stacked
    ("self_attn.q_proj.weight", "self_attn.fused_qkvg_proj.weight", 0, "kda"),
    ("self_attn.k_proj.weight", "self_attn.fused_qkvg_proj.weight", 1, "kda"),
    ("self_attn.v_proj.weight", "self_attn.fused_qkvg_proj.weight", 2, "kda"),
    ("self_attn.g_proj.weight", "self_attn.fused_qkvg_proj.weight", 3, "kda"),
    ("self_attn.q_conv1d.weight", "self_attn.qkv_conv1d.weight", 0, "kda"),
    ("self_attn.k_conv1d.weight", "self_attn.qkv_conv1d.weight", 1, "kda"),
    ("self_attn.v_conv1d.weight", "self_attn.qkv_conv1d.weight", 2, "kda"),
    # dense MLP and shared experts
    ("gate_proj.weight", "gate_up_proj.weight", 0, ""),
    ("up_proj.weight", "gate_up_proj.weight", 1, ""),
    # routed experts (K3 w1/w3/w2 MXFP4; K2 gate/up/down INT4)
    ("experts.{e}.w1.weight", "experts.w13_weight", "w1", ""),
    ("experts.{e}.w3.weight", "experts.w13_weight", "w3", ""),
    ("experts.{e}.w2.weight", "experts.w2_weight", "w2", ""),
    ("experts.{e}.w1.weight_scale", "experts.w13_weight_scale", "w1", ""),
    ("experts.{e}.w3.weight_scale", "experts.w13_weight_scale", "w3", ""),
    ("experts.{e}.w2.weight_scale", "experts.w2_weight_scale", "w2", ""),
    ("experts.{e}.gate_proj.weight", "experts.w13_weight", "w1", ""),
    ("experts.{e}.up_proj.weight", "experts.w13_weight", "w3", ""),
    ("experts.{e}.down_proj.weight", "experts.w2_weight", "w2", ""),
    ("experts.{e}.gate_proj.weight_scale", "experts.w13_weight_scale", "w1", ""),
    ("experts.{e}.up_proj.weight_scale", "experts.w13_weight_scale", "w3", ""),
    ("experts.{e}.down_proj.weight_scale", "experts.w2_weight_scale", "w2", ""),
)

#: whole-name renames applied first (``KimiK3ForConditionalGeneration.hf_to_sglang_mapper``)
RENAMES: tuple[tuple[str, str], ...] = ((".block_sparse_moe.", ".mlp."),)

#: every K3 linear SGLang gives LoRA, as HF leaves: MLA, dense and shared MLPs, KDA's ``o_proj`` and the routed
#: experts (the K3 recipe's adapter; KDA's fused projections have none, ``adapters.prepare_adapter`` refuses them)
K3_LORA_LEAVES = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w3",
    "w2",
)

#: HF LoRA leaf -> SGLang LoRA module (memory-pool buffer) name
LORA_MODULES: dict[str, str] = {
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "q_b_proj": "q_b_proj",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
    "w1": "gate_up_proj_moe",
    "w3": "gate_up_proj_moe",
    "w2": "down_proj_moe",
    "wq_b": "indexer.wq_b",
    "wk": "indexer.wk",
    "weights_proj": "indexer.weights_proj",
}


def _flag_value(leaf: str, module: str) -> str:
    """The ``--lora-target-modules`` value that SGLang normalizes to ``module`` (for HF ``leaf``)."""
    if module.endswith("_moe"):  # routed experts ride on the dense names
        return module[: -len("_moe")]
    if module == "fused_qkv_a_proj_with_mqa" or module.startswith("indexer."):
        return leaf  # SGLang fuses / qualifies these itself (get_normalized_target_modules)
    return module


#: HF LoRA leaf -> ``--lora-target-modules`` value (a member of SUPPORTED_LORA_TARGET_MODULES)
LORA_TARGET_NAMES: dict[str, str] = {leaf: _flag_value(leaf, m) for leaf, m in LORA_MODULES.items()}

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer of a checkpoint or adapter tensor name (``...layers.3.self_attn...`` -> 3), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def hf_to_sglang(name: str, config) -> tuple[str, object, int | None]:
    """``(SGLang parameter name, shard, expert id)`` of checkpoint tensor ``name``.

    :param config: ``kimi_core.config.KimiConfig`` (tells MLA from KDA layers).
    """
    n = name.replace("weight_packed", "weight") if ".experts." in name else name
    for old, new in RENAMES:
        n = n.replace(old, new)
    layer = layer_index(n)
    kind = ("kda" if config.is_kda_layer(layer) else "mla") if layer is not None else ""
    em = _EXPERT.search(n)
    expert = int(em.group(1)) if em and ".shared_experts." not in n else None
    probe = _EXPERT.sub(".experts.{e}.", n) if expert is not None else n
    for hf, sg, shard, where in PARAM_RULES:
        if where and where != kind:
            continue
        if probe.endswith("." + hf) or probe == hf:
            return probe[: len(probe) - len(hf)] + sg, shard, expert
    return n, None, None


def sglang_param_names(names, config) -> dict[str, list[str]]:
    """``{SGLang parameter: [HF tensors that load into it]}`` for checkpoint ``names``."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(hf_to_sglang(n, config)[0], []).append(n)
    return out


def lora_target_modules(hf_leaves) -> list[str]:
    """``--lora-target-modules`` values for PEFT ``target_modules`` leaves (unknown leaves raise).

    Expert leaves (``w1``/``w3``/``w2``) bring in both ``gate_up_proj`` and ``down_proj``, which
    SGLang needs together to give the routed experts LoRA. The same list is what to put in the
    ``target_modules`` of the adapter config sent to SGLang: it checks that the adapter's
    (normalized) targets are a subset of the flag's.
    """
    out = set()
    for leaf in hf_leaves:
        if leaf not in LORA_TARGET_NAMES:
            raise KeyError(
                f"LoRA target {leaf!r} has no SGLang --lora-target-modules name (known: {sorted(LORA_TARGET_NAMES)})"
            )
        out.add(LORA_TARGET_NAMES[leaf])
        if leaf in ("w1", "w3", "w2"):
            out.update(("gate_up_proj", "down_proj"))
    return sorted(out)
