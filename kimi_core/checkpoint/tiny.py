"""Tiny random Kimi checkpoints in the real on-disk format (``kimi-rl make-tiny``).

Real HF tensor names and config fields, experts in the model's real 4-bit format, deterministic
for a seed, small enough for CPU tests (hidden 256, <= 6 layers, 16 experts) but with MLA
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64, which vLLM's CPU MLA backend requires.

Weights are scaled so activations stay O(1): projections ~ N(0, 1/in), residual writers
(``o_proj``, ``down_proj``, ``w2``) further divided by ``sqrt(2 L)``, embeddings ~ N(0, 1),
norms ~ 1 + N(0, 0.1^2). Small floats (``A_log``, ``dt_bias``, conv weights, router bias) are fp32
as in the releases; everything else is bf16.
"""

from __future__ import annotations

import copy
import math
import os

import torch

from kimi_core.checkpoint.folders import FolderRefused, check_output_folder
from kimi_core.checkpoint.remote_config import AUTO_MAP, write_remote_config
from kimi_core.checkpoint.tokenizer import BOS_ID, EOS_ID, MEDIA_ID, PAD_ID, write_tokenizer
from kimi_core.checkpoint.writer import replace_directory, write_checkpoint
from kimi_core.config import FAMILIES, KimiConfig
from kimi_core.quant import int4, mxfp4
from kimi_core.quant.int4 import CONVENTIONS
from kimi_core.release_configs import k3_release_config

MODELS = tuple(FAMILIES)  # k2, k25, k3, k31
MAX_LAYERS = 6

_K2_TEXT = {
    "model_type": "kimi_k2",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 64.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 262144,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "ep_size": 1,
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
}


def _k3_text() -> dict:
    """The K3 release text config at tiny sizes (every other field as released)."""
    text = k3_release_config()["text_config"]
    text.update(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=5,
        intermediate_size=512,
        num_experts=16,
        num_experts_per_token=4,
        moe_intermediate_size=64,
        routed_expert_hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=128,
        attn_res_block_size=2,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    text["linear_attn_config"].update(num_heads=4, head_dim=32, kda_layers=[], full_attn_layers=[])
    return text


_K31_INDEXER = {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}

#: ``size="small"``: the seeds' GPU demos. The release's MLA head sizes (q_lora 1536, kv_lora 512, nope 128,
#: rope 64, v 128), hidden 1024, 8 heads, 64 routed experts top-8, and every width a multiple of what the GPU
#: engines' kernels assume (Marlin MoE: expert input % 256, intermediate % 128; SGLang's attention residuals:
#: hidden % 1024; SGLang's KDA: KDA heads = MLA heads, head_dim = v_head_dim; its DSA pool: index_head_dim 128;
#: DeepGEMM's indexer scores on SM90: 32 or 64 indexer heads).
SIZES = ("tiny", "small")
_SMALL_COMMON = {
    "vocab_size": 4096,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 1536,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
}
_SMALL_K2 = {**_SMALL_COMMON, "n_routed_experts": 64, "num_experts_per_tok": 8}
_SMALL_K3 = {**_SMALL_COMMON, "num_experts": 64, "num_experts_per_token": 8, "routed_expert_hidden_size": 512}
_SMALL_KDA = {"num_heads": 8, "head_dim": 128}
_SMALL_K31_INDEXER = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 64}

# vision fields only (no vision weights): vLLM builds the projector from them even when it
# serves text only (``language_model_only``; on the meta device, then drops it)
_VISION_STUB = {
    "patch_size": 14,
    "vt_hidden_size": 1152,
    "vt_num_hidden_layers": 1,
    "mm_projector_type": "patchmergerv2",
    "projector_ln_eps": 1e-5,
}

_INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
_MXFP4_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*\\.mlp\\..*",
    "re:.*routed_expert_.*",
    "re:.*block_sparse_moe\\.gate$",
    "re:vision_tower.*",
    "re:mm_projector.*",
]


def tiny_config(model: str, quant: str | None = None, layers: int | None = None, size: str = "tiny") -> dict:
    """The HF ``config.json`` dict of a tiny ``model`` (k2, k25, k3, k31).

    :param quant: ``"int4"``, ``"mxfp4"`` or ``"none"``; default is the release's format
        (INT4 for K2.x, MXFP4 for K3/K3.1).
    :param layers: number of decoder layers (2..6).
    :param size: ``"tiny"`` (CPU tests: hidden 256, 16 experts) or ``"small"`` (GPU demos, see :data:`_SMALL_K2`).
    """
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: expected one of {MODELS}")
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: expected one of {SIZES}")
    quant = quant or ("mxfp4" if model in ("k3", "k31") else "int4")
    if quant not in ("int4", "mxfp4", "none"):
        raise ValueError(f"--quant {quant!r}: expected int4, mxfp4 or none")
    want = "mxfp4" if model in ("k3", "k31") else "int4"
    if quant not in ("none", want):
        raise ValueError(f"--quant {quant}: {model} experts are {want} in the release (or use --quant none)")
    if model in ("k2", "k25"):
        text = copy.deepcopy(_K2_TEXT)
    else:
        text = _k3_text()
        if model == "k31":
            text.update(_K31_INDEXER)
    if size == "small":
        if model in ("k2", "k25"):
            text.update(_SMALL_K2)
        else:
            text.update(_SMALL_K3)
            text["linear_attn_config"].update(_SMALL_KDA)
            if model == "k31":
                text.update(_SMALL_K31_INDEXER)
    if layers is not None:
        if not 2 <= layers <= MAX_LAYERS:
            raise ValueError(f"--layers {layers}: tiny checkpoints have 2..{MAX_LAYERS} layers")
        text["num_hidden_layers"] = layers
    L = text["num_hidden_layers"]
    if "linear_attn_config" in text:
        # 1-based; MLA at multiples of 4 and at the last layer, KDA elsewhere (the K3 schedule)
        full = [i for i in range(1, L + 1) if i % 4 == 0 or i == L]
        text["linear_attn_config"]["full_attn_layers"] = full
        text["linear_attn_config"]["kda_layers"] = [i for i in range(1, L + 1) if i not in full]
    qc = None
    if quant != "none":
        from kimi_core.config import QuantSpec

        qc = QuantSpec(
            format=mxfp4.FORMAT if quant == "mxfp4" else int4.FORMAT,
            ignore=tuple(_MXFP4_IGNORE if quant == "mxfp4" else _INT4_IGNORE),
        ).to_hf()
    if model == "k2":
        cfg = {"architectures": [FAMILIES["k2"]], "auto_map": dict(AUTO_MAP), **text}
        if qc:
            cfg["quantization_config"] = qc
        return cfg
    top_type = {"k25": "kimi_k25", "k3": "kimi_k3", "k31": "kimi_k31"}[model]
    cfg = {
        "architectures": [FAMILIES[model]],
        "model_type": top_type,
        "text_config": text,
        "vision_config": dict(_VISION_STUB),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "media_placeholder_token_id": MEDIA_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if qc:
        cfg["quantization_config"] = qc
    return cfg


class _Init:
    """Deterministic weight factory (one generator, draws in a fixed order)."""

    def __init__(self, seed: int, num_layers: int):
        self.g = torch.Generator().manual_seed(seed)
        self.resid = 1.0 / math.sqrt(2 * num_layers)

    def randn(self, *shape, std=1.0):
        return torch.randn(*shape, generator=self.g) * std

    def linear(self, out, inp, residual=False):
        return (self.randn(out, inp, std=1.0 / math.sqrt(inp)) * (self.resid if residual else 1.0)).to(torch.bfloat16)

    def norm(self, n):
        return (1.0 + self.randn(n, std=0.1)).to(torch.bfloat16)


def _experts(init: _Init, cfg: KimiConfig, moe: str, quant: str, convention: str, out: dict) -> None:
    H, inter, E = cfg.expert_in_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    gate_n, up_n, down_n = cfg.expert_names
    for e in range(E):
        for name, (o, i, resid) in ((gate_n, (inter, H, False)), (up_n, (inter, H, False)), (down_n, (H, inter, True))):
            w = init.linear(o, i, residual=resid)
            key = f"{moe}.experts.{e}.{name}"
            if quant == "none":
                out[f"{key}.weight"] = w
            elif quant == "int4":
                sd, qmin = CONVENTIONS[convention]
                out.update({f"{key}.{k}": v for k, v in int4.quantize(w, sd, qmin).items()})
            else:
                out.update({f"{key}.{k}": v for k, v in mxfp4.quantize(w).items()})


def _mlp(init: _Init, prefix: str, hidden: int, inter: int, out: dict) -> None:
    out[f"{prefix}.gate_proj.weight"] = init.linear(inter, hidden)
    out[f"{prefix}.up_proj.weight"] = init.linear(inter, hidden)
    out[f"{prefix}.down_proj.weight"] = init.linear(hidden, inter, residual=True)


def _mla(init: _Init, cfg: KimiConfig, p: str, out: dict) -> None:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out[f"{p}.q_a_proj.weight"] = init.linear(cfg.q_lora_rank, H)
    out[f"{p}.q_a_layernorm.weight"] = init.norm(cfg.q_lora_rank)
    out[f"{p}.q_b_proj.weight"] = init.linear(nh * cfg.qk_head_dim, cfg.q_lora_rank)
    out[f"{p}.kv_a_proj_with_mqa.weight"] = init.linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    out[f"{p}.kv_a_layernorm.weight"] = init.norm(cfg.kv_lora_rank)
    out[f"{p}.kv_b_proj.weight"] = init.linear(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[f"{p}.o_proj.weight"] = init.linear(H, nh * cfg.v_head_dim, residual=True)
    if cfg.mla_use_output_gate:
        out[f"{p}.g_proj.weight"] = init.linear(nh * cfg.v_head_dim, H)
    if cfg.has_indexer:
        d, nih = cfg.index_head_dim, cfg.index_n_heads
        out[f"{p}.indexer.wq_b.weight"] = init.linear(nih * d, cfg.q_lora_rank)
        out[f"{p}.indexer.wk.weight"] = init.linear(d, H)
        out[f"{p}.indexer.k_norm.weight"] = init.norm(d)
        out[f"{p}.indexer.k_norm.bias"] = init.randn(d, std=0.1).to(torch.bfloat16)
        out[f"{p}.indexer.weights_proj.weight"] = init.linear(nih, H)


def _kda(init: _Init, cfg: KimiConfig, p: str, out: dict) -> None:
    la = cfg.linear_attn
    H, nh, d, ks = cfg.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
    P = nh * d
    for n in ("q", "k", "v"):
        out[f"{p}.{n}_proj.weight"] = init.linear(P, H)
    for n in ("q", "k", "v"):
        out[f"{p}.{n}_conv1d.weight"] = init.randn(P, 1, ks, std=1.0 / math.sqrt(ks))
    out[f"{p}.f_a_proj.weight"] = init.linear(d, H)
    out[f"{p}.f_b_proj.weight"] = init.linear(P, d)
    out[f"{p}.b_proj.weight"] = init.linear(nh, H)
    if la.use_full_rank_gate:
        out[f"{p}.g_proj.weight"] = init.linear(P, H)
    else:
        out[f"{p}.g_a_proj.weight"] = init.linear(d, H)
        out[f"{p}.g_b_proj.weight"] = init.linear(P, d)
    # A_log = log(U(1, 16)) per head, zero-padded to head_dim as the K3 release stores it
    a = torch.zeros(max(d, nh))
    a[:nh] = torch.log(1.0 + 15.0 * torch.rand(nh, generator=init.g))
    out[f"{p}.A_log"] = a
    out[f"{p}.dt_bias"] = init.randn(P, std=0.1)
    out[f"{p}.o_norm.weight"] = init.norm(d)
    out[f"{p}.o_proj.weight"] = init.linear(H, P, residual=True)


def tiny_state_dict(config: dict, quant: str, convention: str = "kimi", seed: int = 0) -> dict[str, torch.Tensor]:
    """All tensors of a tiny checkpoint for the HF ``config`` dict, keyed by HF names."""
    cfg = KimiConfig.from_hf(config, where="tiny config")
    init = _Init(seed, cfg.num_hidden_layers)
    H, lm = cfg.hidden_size, cfg.lm_prefix
    out: dict[str, torch.Tensor] = {f"{lm}model.embed_tokens.weight": init.randn(cfg.vocab_size, H).to(torch.bfloat16)}
    for i in range(cfg.num_hidden_layers):
        p = cfg.layer_prefix(i).rstrip(".")
        out[f"{p}.input_layernorm.weight"] = init.norm(H)
        out[f"{p}.post_attention_layernorm.weight"] = init.norm(H)
        if cfg.is_k3_family:
            for n in ("self_attention_res", "mlp_res"):
                out[f"{p}.{n}_norm.weight"] = init.norm(H)
                out[f"{p}.{n}_proj.weight"] = init.linear(1, H)
        (_kda if cfg.is_kda_layer(i) else _mla)(init, cfg, f"{p}.self_attn", out)
        if not cfg.is_moe_layer(i):
            _mlp(init, f"{p}.mlp", H, cfg.intermediate_size, out)
            continue
        moe = f"{p}.{cfg.moe_prefix}"
        out[f"{moe}.gate.weight"] = init.linear(cfg.n_routed_experts, H)
        out[f"{moe}.gate.e_score_correction_bias"] = init.randn(cfg.n_routed_experts, std=0.05)
        if cfg.routed_expert_hidden_size:
            lat = cfg.routed_expert_hidden_size
            out[f"{moe}.routed_expert_down_proj.weight"] = init.linear(lat, H)
            out[f"{moe}.routed_expert_norm.weight"] = init.norm(lat)
            out[f"{moe}.routed_expert_up_proj.weight"] = init.linear(H, lat, residual=True)
        _experts(init, cfg, moe, quant, convention, out)
        if cfg.n_shared_experts:
            _mlp(init, f"{moe}.shared_experts", H, cfg.moe_intermediate_size * cfg.n_shared_experts, out)
    out[f"{lm}model.norm.weight"] = init.norm(H)
    if cfg.is_k3_family:
        out[f"{lm}model.output_attn_res_norm.weight"] = init.norm(H)
        out[f"{lm}model.output_attn_res_proj.weight"] = init.linear(1, H)
    out[f"{lm}lm_head.weight"] = init.linear(cfg.vocab_size, H)
    return out


def make_tiny(
    model: str,
    out_dir: str | os.PathLike,
    quant: str | None = None,
    convention: str = "kimi",
    seed: int = 0,
    layers: int | None = None,
    max_shard_bytes: int = 2 * 2**20,
    size: str = "tiny",
) -> str:
    """Write a tiny checkpoint of ``model`` to ``out_dir`` and return the directory.

    The folder holds the weights, ``config.json`` and a word-level tokenizer with a chat template
    (:func:`kimi_core.checkpoint.tokenizer.write_tokenizer`), so hosts that load one from the model folder run it.

    An existing checkpoint at ``out_dir`` is replaced as a whole (:func:`replace_directory`: no shard of it is
    left beside the new one); a file there, or a non-empty folder that is not a checkpoint, is refused.

    :param quant: ``int4`` / ``mxfp4`` / ``none``; default: the release format of ``model``.
    :param size: ``tiny`` or ``small`` (:func:`tiny_config`).
    :param convention: INT4 scale convention, ``kimi`` (amax/7, q in [-7, 7]) or ``rtn`` (amax/7.5, [-8, 7]);
        only INT4 experts have one, so ``rtn`` with MXFP4 or unquantized experts is refused.
    :param max_shard_bytes: shard size; small by default so readers are exercised on several shards.
    :raises FolderRefused: ``out_dir`` is a file or a folder holding something else than a checkpoint.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"--convention {convention!r}: expected one of {sorted(CONVENTIONS)}")
    cfg = tiny_config(model, quant, layers, size)
    q = quant or ("mxfp4" if model in ("k3", "k31") else "int4")
    if convention != "kimi" and q != "int4":
        raise ValueError(
            f"--convention {convention}: only INT4 experts have a scale convention; {model} with "
            f"--quant {q} has none (drop --convention, or use --model k2/k25 with INT4 experts)"
        )
    out_dir = check_output_folder(out_dir, "--out")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, "config.json")):
        raise FolderRefused(
            f"--out {out_dir}: a non-empty folder that holds no checkpoint (no config.json); "
            "make-tiny replaces only an earlier checkpoint; name a new or empty folder"
        )
    tensors = tiny_state_dict(cfg, q, convention, seed)
    text = cfg.get("text_config", cfg)

    def fill(d: str) -> None:
        write_checkpoint(d, tensors, cfg, max_shard_bytes=max_shard_bytes)
        write_tokenizer(d, text["vocab_size"], text["max_position_embeddings"])
        if "auto_map" in cfg:
            write_remote_config(d)

    replace_directory(out_dir, fill)
    return out_dir
