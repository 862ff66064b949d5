"""The one name table between HF Kimi checkpoints and this plugin's Megatron modules.

:data:`RULES` is data: ``(megatron regex, HF template(s), split)``, matched against megatron
state-dict names (``decoder.layers.{L}.`` already replaced by ``layer.``). HF templates use
``{lm}`` (``""`` for K2 text, ``"language_model."`` otherwise), ``{lp}`` (``{lm}model.layers.{i}``,
global 0-based ``i``), ``{moe}`` (``{lp}.mlp`` or ``{lp}.block_sparse_moe``), ``{e}`` (global
expert id) and regex groups ``\\1``. Splits say how a rank's piece is cut from the HF tensor:

=========  ===================================================================================
``rep``    replicated: the whole tensor on every rank
``col``    tensor parallel along dim 0 (column-parallel outputs, vocab rows)
``row``    tensor parallel along dim 1 (row-parallel inputs)
``glu``    ``[gate_shard; up_shard]`` of two HF tensors, each split along dim 0 (megatron GLU fc1)
``expert`` one HF module per local expert, stacked on a new dim 0 (expert parallelism)
=========  ===================================================================================

Format quirks are paired hooks (``import_hook`` / ``export_hook``): ``A_log`` is stored
zero-padded (to ``head_dim`` in the K3 release) and kept unpadded here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kimi_core.reference.kda import unpad_a_log

__all__ = ["Rule", "RULES", "match", "hf_names", "A_LOG_HOOKS", "FP32_TENSORS"]

# HF tensors the releases store in fp32 (everything else dense is bf16) - the export dtype default
FP32_TENSORS = re.compile(r".*\.(A_log|dt_bias|[qkv]_conv1d\.weight|e_score_correction_bias)$")


@dataclass(frozen=True)
class Rule:
    megatron: str  # regex over the normalised megatron name
    hf: tuple[str, ...]  # HF templates (two for glu)
    split: str  # rep | col | row | glu | expert
    hook: str | None = None  # name of a quirk hook pair in HOOKS

    def __post_init__(self):
        object.__setattr__(self, "_re", re.compile(self.megatron))


def _r(meg: str, hf, split: str, hook: str | None = None) -> Rule:
    return Rule(meg, (hf,) if isinstance(hf, str) else tuple(hf), split, hook)


RULES: tuple[Rule, ...] = (
    # model level
    _r(r"embedding\.word_embeddings\.weight", "{lm}model.embed_tokens.weight", "col"),
    _r(r"output_layer\.weight", "{lm}lm_head.weight", "col"),
    _r(r"decoder\.final_layernorm\.weight", "{lm}model.norm.weight", "rep"),
    _r(r"decoder\.final_layernorm\.(output_attn_res_norm|output_attn_res_proj)\.weight", r"{lm}model.\1.weight", "rep"),
    # layer norms and attention-residual parameters
    _r(r"layer\.input_layernorm\.weight", "{lp}.input_layernorm.weight", "rep"),
    _r(r"layer\.pre_mlp_layernorm\.weight", "{lp}.post_attention_layernorm.weight", "rep"),
    _r(r"layer\.(self_attention_res|mlp_res)_(norm|proj)\.weight", r"{lp}.\1_\2.weight", "rep"),
    # MLA (megatron names <- DeepSeek / Kimi HF names)
    _r(r"layer\.self_attention\.linear_q_down_proj\.weight", "{lp}.self_attn.q_a_proj.weight", "col"),
    _r(r"layer\.self_attention\.linear_q_proj\.weight", "{lp}.self_attn.q_proj.weight", "col"),
    _r(r"layer\.self_attention\.linear_q_up_proj\.weight", "{lp}.self_attn.q_b_proj.weight", "col"),
    _r(r"layer\.self_attention\.linear_kv_down_proj\.weight", "{lp}.self_attn.kv_a_proj_with_mqa.weight", "col"),
    _r(r"layer\.self_attention\.linear_kv_up_proj\.weight", "{lp}.self_attn.kv_b_proj.weight", "col"),
    _r(r"layer\.self_attention\.q_layernorm\.weight", "{lp}.self_attn.q_a_layernorm.weight", "rep"),
    _r(r"layer\.self_attention\.kv_layernorm\.weight", "{lp}.self_attn.kv_a_layernorm.weight", "rep"),
    _r(r"layer\.self_attention\.linear_proj\.weight", "{lp}.self_attn.o_proj.weight", "row"),
    _r(r"layer\.self_attention\.linear_g_proj\.weight", "{lp}.self_attn.g_proj.weight", "col"),
    _r(r"layer\.self_attention\.indexer\.(wq_b|wk|weights_proj)\.weight", r"{lp}.self_attn.indexer.\1.weight", "rep"),
    _r(r"layer\.self_attention\.indexer\.k_norm\.(weight|bias)", r"{lp}.self_attn.indexer.k_norm.\1", "rep"),
    # KDA (module names are the HF ones)
    _r(r"layer\.self_attention\.(q|k|v|g|f_b|b|g_b)_proj\.weight", r"{lp}.self_attn.\1_proj.weight", "col"),
    _r(r"layer\.self_attention\.(f_a|g_a)_proj\.weight", r"{lp}.self_attn.\1_proj.weight", "rep"),
    _r(r"layer\.self_attention\.(q|k|v)_conv1d\.weight", r"{lp}.self_attn.\1_conv1d.weight", "col"),
    _r(r"layer\.self_attention\.A_log", "{lp}.self_attn.A_log", "col", hook="a_log"),
    _r(r"layer\.self_attention\.dt_bias", "{lp}.self_attn.dt_bias", "col"),
    _r(r"layer\.self_attention\.o_norm\.weight", "{lp}.self_attn.o_norm.weight", "rep"),
    _r(r"layer\.self_attention\.o_proj\.weight", "{lp}.self_attn.o_proj.weight", "row"),
    # dense MLP (first_k_dense_replace layers)
    _r(r"layer\.mlp\.linear_fc1\.weight", ("{lp}.mlp.gate_proj.weight", "{lp}.mlp.up_proj.weight"), "glu"),
    _r(r"layer\.mlp\.linear_fc2\.weight", "{lp}.mlp.down_proj.weight", "row"),
    # MoE
    _r(r"layer\.mlp\.router\.weight", "{moe}.gate.weight", "rep"),
    _r(r"layer\.mlp\.router\.expert_bias", "{moe}.gate.e_score_correction_bias", "rep"),
    _r(
        r"layer\.mlp\.shared_experts\.linear_fc1\.weight",
        ("{moe}.shared_experts.gate_proj.weight", "{moe}.shared_experts.up_proj.weight"),
        "glu",
    ),
    _r(r"layer\.mlp\.shared_experts\.linear_fc2\.weight", "{moe}.shared_experts.down_proj.weight", "row"),
    _r(r"layer\.mlp\.routed_expert_(down_proj|up_proj|norm)\.weight", r"{moe}.routed_expert_\1.weight", "rep"),
    # routed experts: packed on-disk tensors (w4a16) or logical weights (qat / dense masters)
    _r(r"layer\.mlp\.experts\.(gate|up|down)_(packed|scale)", r"{moe}.experts.{e}.{\1}.weight_\2", "expert"),
    _r(r"layer\.mlp\.experts\.(gate|up|down)_weight", r"{moe}.experts.{e}.{\1}", "expert"),
)

# megatron state-dict entries that are not weights (rebuilt at runtime)
IGNORED = re.compile(r".*(rotary_pos_emb\..*|local_tokens_per_expert|_extra_state)$")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def normalise(name: str) -> tuple[str, int | None]:
    """``decoder.layers.3.x`` -> ``("layer.x", 3)`` (local layer index); other names unchanged."""
    m = _LAYER.match(name)
    if not m:
        return name, None
    return "layer." + name[m.end() :], int(m.group(1))


def match(megatron_name: str) -> tuple[Rule, re.Match, int | None] | None:
    """The rule for a megatron state-dict name, its regex match and the local layer index (or None)."""
    norm, local = normalise(megatron_name)
    for rule in RULES:
        m = rule._re.fullmatch(norm)
        if m:
            return rule, m, local
    return None


def hf_names(rule: Rule, m: re.Match, kimi, layer: int | None, expert: int | None = None) -> list[str]:
    """HF names of one megatron entry (``layer`` global 0-based, ``expert`` global id for expert rules)."""
    lm = kimi.lm_prefix
    lp = f"{lm}model.layers.{layer}" if layer is not None else ""
    moe = f"{lp}.{kimi.moe_prefix}"
    proj = dict(zip(("gate", "up", "down"), kimi.expert_names))
    out = []
    for t in rule.hf:
        s = m.expand(t.replace("{lm}", lm).replace("{lp}", lp).replace("{moe}", moe))
        if "{" in s:
            s = s.replace("{e}", str(expert)).format(**proj)
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------- hooks
def _a_log_import(t: torch.Tensor, kimi, name: str) -> torch.Tensor:
    """HF ``A_log`` (zero-padded) -> ``[num_heads]``; non-zero padding is an error naming the tensor."""
    return unpad_a_log(t, kimi.linear_attn.num_heads, name)


def _a_log_export(t: torch.Tensor, kimi, name: str, hf_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[num_heads]`` -> the HF layout: zero-padded to ``hf_shape`` (recorded at import) or to ``head_dim``."""
    la = kimi.linear_attn
    shape = tuple(hf_shape) if hf_shape else (max(la.head_dim, la.num_heads),)
    out = torch.zeros(shape, dtype=t.dtype).reshape(-1)
    out[: t.numel()] = t.reshape(-1)
    return out.reshape(shape)


HOOKS: dict[str, tuple[Callable, Callable]] = {"a_log": (_a_log_import, _a_log_export)}
A_LOG_HOOKS = HOOKS["a_log"]
