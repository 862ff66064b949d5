"""The plugin's one HF-name -> vLLM-name table, and the routed-expert name parser.

======================================================  =========================================================
HF checkpoint / adapter name                            vLLM module or parameter (CPU path)
======================================================  =========================================================
``...layers.{l}.self_attn.q_a_proj`` +                  ``...self_attn.fused_qkv_a_proj`` (vLLM stacks them;
``...self_attn.kv_a_proj_with_mqa``                     LoRA: ``packed_modules_mapping["fused_qkv_a_proj"]``)
``...mlp.gate_proj`` + ``...mlp.up_proj``               ``...mlp.gate_up_proj`` (also ``shared_experts``)
``...mlp.gate.weight``, ``.e_score_correction_bias``    ``...mlp.gate`` (:class:`~.moe_lora.KimiRouter`)
``...mlp.experts.{e}.{gate,up,down}_proj.<t>``          ``...mlp.experts.w13[e]`` (gate rows, up rows) / ``.w2[e]``,
 (``<t>``: ``weight`` or ``weight_packed``/``_scale``)   dequantized at load (:class:`~.moe_lora.KimiCpuExperts`)
``language_model.model.layers.`` (K2.5 / K3)            ``language_model.model.layers.`` (vLLM's ``hf_to_vllm_mapper``)
======================================================  =========================================================

LoRA adapters use the same HF module names (``kimi_core.lora.naming``); vLLM reads the per-expert
form through ``packed_modules_mapping["experts"]`` (:func:`expert_lora_names`).
"""

from __future__ import annotations

import re

__all__ = ["EXPERT_RE", "PACKED_LINEARS", "hf_modules", "parse_expert_name", "expert_lora_names", "expert_mapping"]

#: vLLM linear that stacks several HF linears (output-dim concatenation, in this order)
PACKED_LINEARS: dict[str, tuple[str, ...]] = {
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def hf_modules(vllm_module: str) -> list[str]:
    """HF module names a vLLM linear computes, in output order (``...fused_qkv_a_proj`` -> q_a, kv_a)."""
    head, _, leaf = vllm_module.rpartition(".")
    parts = PACKED_LINEARS.get(leaf, (leaf,))
    return [f"{head}.{p}" if head else p for p in parts]


#: ``<moe>.experts.{e}.<proj>.<kind>`` with kind weight / weight_packed / weight_scale / weight_shape
EXPERT_RE = re.compile(
    r"^(?P<moe>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[a-z_0-9]+)\.(?P<kind>weight(?:_packed|_scale|_shape)?)$"
)


def parse_expert_name(name: str):
    """``(moe module, expert, proj, kind)`` of a routed-expert tensor name, or ``None``."""
    m = EXPERT_RE.match(name)
    if m is None or m.group("moe").endswith("shared"):
        return None
    return m.group("moe"), int(m.group("e")), m.group("proj"), m.group("kind")


def expert_mapping(
    num_experts: int, gate: str = "gate_proj", down: str = "down_proj", up: str = "up_proj"
) -> list[tuple[str, str, int, str]]:
    """vLLM's ``get_expert_mapping`` rows ``(param prefix, checkpoint prefix, expert, shard)``.

    Order per expert is w1 (gate), w2 (down), w3 (up): the triplet order vLLM's
    ``PackedLoRALayerWeights.pack_moe`` expects.
    """
    rows = []
    for e in range(num_experts):
        for shard, ck in (("w1", gate), ("w2", down), ("w3", up)):
            rows.append(("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{e}.{ck}.", e, shard))
    return rows


def expert_lora_names(
    num_experts: int, gate: str = "gate_proj", down: str = "down_proj", up: str = "up_proj"
) -> list[str]:
    """``packed_modules_mapping["experts"]``: ``experts.{e}.<proj>`` in w1, w2, w3 order per expert."""
    return [w.rstrip(".") for _, w, _, _ in expert_mapping(num_experts, gate, down, up)]
