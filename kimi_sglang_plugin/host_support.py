"""The SGLang releases this plugin was checked against, as data, and what the Kimi models become where the
running SGLang is not one of them.

Releases as data. :data:`FACTS` records, for every SGLang symbol the plugin relies on, what each supported
release has there (kind, parameter names, ``file:line`` under ``sglang/``), read from the release wheels.
A patch written against one release's internals is only right where those internals are the recorded
ones: a target that vanished, or whose signature changed, must stop the Kimi models at startup with a
message naming it, never be skipped. A row exists only where the plugin relies on the symbol in that
release (the patch ledger, :mod:`kimi_sglang_plugin.patches`, says which patch applies where). Who checks
the rows:

* every SGLang process, at ``register()`` (:func:`check_release`, and the ledger's own check);
* ``tests/kimi_sglang_plugin/test_host_support.py``: the live 0.5.23 of the CPU lane against its rows, and an
  unpacked 0.5.17 wheel against its rows when ``KIMI_SGLANG_SRC_0517`` names one.

Parameter names are compared in order; ``*name`` / ``**name`` mark variadic parameters. ``fields`` rows list
the dataclass fields the plugin reads (a subset check).

Refusal stand-ins. SGLang catches an exception raised by a plugin's ``register()`` (``plugins/__init__.py``:
"Failed to execute general plugin") and serves stock code, so a raising plugin only shows a K3.1 user
"architectures ... are not supported" and a K3 user a model without the plugin's fixes. Where the plugin
cannot run, :func:`refuse` logs the reason at ERROR (visible before SGLang configures logging: Python's
last-resort handler prints it) and puts, under each Kimi K3-family architecture (:data:`REFUSED_ARCHS`), a
class whose constructor raises :class:`kimi_core.errors.PluginError` with that reason. The scheduler builds
the model, so the message ends the engine start and is what the user reads. Every other architecture,
DeepSeek-V3 / Kimi K2.x included, is untouched.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pkgutil
from typing import NamedTuple

from kimi_core.architectures import K3, K3_LINEAR, K31
from kimi_core.errors import PluginError

__all__ = [
    "SUPPORTED_SGLANG",
    "Fact",
    "FACTS",
    "fn",
    "cls",
    "attr",
    "fields",
    "ABSENT",
    "sglang_version",
    "live_fact",
    "compare",
    "check_release",
    "symbols_for",
    "REFUSED_ARCHS",
    "refusal_class",
    "refuse",
]

logger = logging.getLogger(__name__)

#: SGLang releases whose internals the patches were written against
SUPPORTED_SGLANG = ("0.5.17", "0.5.23")


def sglang_version() -> str:
    """Installed SGLang version, ``""`` if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


class Fact(NamedTuple):
    """What one release has at one symbol."""

    where: str  # file:line under sglang/ in that release ("" when absent)
    kind: str  # "function" | "class" | "attr" | "fields" | "absent"
    params: tuple[str, ...] = ()  # function: parameter names; fields: the dataclass fields read


def fn(where: str, *params: str) -> Fact:
    return Fact(where, "function", params)


def cls(where: str) -> Fact:
    return Fact(where, "class")


def attr(where: str) -> Fact:
    return Fact(where, "attr")


def fields(where: str, *names: str) -> Fact:
    return Fact(where, "fields", names)


ABSENT = Fact("", "absent")

_KIMI_LINEAR_CONFIG_INIT = (
    "self",
    "model_type",
    "vocab_size",
    "hidden_size",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "moe_intermediate_size",
    "moe_renormalize",
    "moe_router_activation_func",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "moe_layer_freq",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "topk_method",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_nope",
    "num_nextn_predict_layers",
    "linear_attn_config",
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "mla_use_output_gate",
    "max_position_embeddings",
    "**kwargs",
)
_K3_MLA_INIT = (
    "self",
    "config",
    "layer_idx",
    "quant_config",
    "all_reduce_fusion",
    "prefix",
    "alt_stream",
    "gate_alt_stream",
)
_GET_HIDDEN_DIM = ("module_name", "config", "base_model", "layer_idx", "lora_added_vocab_size")
_RUN_FROM_DISPATCH = ("self", "dispatch_output", "quant_info", "runner_config", "hooks")
_SITU = ("input", "out", "beta", "linear_beta")
_ATTN_RES_MIX = ("prefix_sum", "bank", "nvb", "score_proj", "score_norm")
_ABSORB_CORE = (
    "self",
    "q_pe",
    "k_pe",
    "q_nope_out",
    "k_nope",
    "forward_batch",
    "zero_allocator",
    "positions",
    "topk_indices",
    "llama_4_scaling",
    "fusion_plan",
)
_RUNNER_FIELDS = ("activation", "is_gated", "gemm1_alpha", "gemm1_clamp_limit", "gate_up_interleaved")

_S = "sglang.srt."
#: symbol -> {release: Fact}
FACTS: dict[str, dict[str, Fact]] = {
    # ---------------------------------------------------------------- K3.1 gates (patches/k31_dsa_gates.py)
    _S + "configs.model_config.is_deepseek_dsa": {
        "0.5.17": fn("srt/configs/model_config.py:106", "config"),
        "0.5.23": fn("srt/configs/model_config.py:191", "config"),
    },
    _S + "configs.model_config.ModelConfig._derive_model_shapes": {
        "0.5.17": fn("srt/configs/model_config.py:801", "self"),
        "0.5.23": fn("srt/configs/model_config.py:1331", "self"),
    },
    _S + "models.registry._ModelRegistry.resolve_model_cls": {
        "0.5.17": fn("srt/models/registry.py:80", "self", "architectures"),
        "0.5.23": fn("srt/models/registry.py:93", "self", "architectures"),
    },
    # ------------------------------------------------ #37704 fixes (patches/lora_*.py, patches/kda_f_b_proj_alias.py)
    _S + "configs.kimi_linear.KimiLinearConfig.__init__": {
        "0.5.17": fn("srt/configs/kimi_linear.py:14", *_KIMI_LINEAR_CONFIG_INIT),
        "0.5.23": fn("srt/configs/kimi_linear.py:16", *_KIMI_LINEAR_CONFIG_INIT),
    },
    _S + "models.kimi_k3.KimiK3MLAAttention.__init__": {
        "0.5.17": fn("srt/models/kimi_k3.py:1706", *_K3_MLA_INIT),
        "0.5.23": fn("srt/models/kimi_k3.py:2160", *_K3_MLA_INIT, "sp_moe"),
    },
    # the output gate: 0.5.17 issues g_proj on an alt stream into _gate_precomputed (or computes it in
    # the o_proj wrapper); 0.5.23 computes it in _compute_output_gate, joining _gate_pending_stream
    _S + "models.kimi_k3.KimiK3MLAAttention._precompute_output_gate": {
        "0.5.17": fn("srt/models/kimi_k3.py:1838", "self", "hidden_states"),
        "0.5.23": ABSENT,
    },
    _S + "models.kimi_k3.KimiK3MLAAttention._compute_output_gate": {
        "0.5.17": ABSENT,
        "0.5.23": fn("srt/models/kimi_k3.py:2353", "self", "hidden_states"),
    },
    _S + "lora.layers.RowParallelLinearWithLoRA.forward": {
        "0.5.17": fn("srt/lora/layers.py:771", "self", "input_", "skip_all_reduce", "forward_batch"),
        "0.5.23": fn("srt/lora/layers.py:834", "self", "input_", "skip_all_reduce", "forward_batch"),
    },
    # 0.5.23 moved the config-driven dims into get_default_hidden_dim (utils.py:172); get_hidden_dim,
    # the function the LoRA memory pool calls, is the same in both
    _S + "lora.utils.get_hidden_dim": {
        "0.5.17": fn("srt/lora/utils.py:106", *_GET_HIDDEN_DIM),
        "0.5.23": fn("srt/lora/utils.py:146", *_GET_HIDDEN_DIM),
    },
    # attention residuals at widths that are not multiples of 1024 (patches/attn_residual_width.py)
    _S + "layers.attn_residual._mix_fused": {
        "0.5.17": fn("srt/layers/attn_residual.py:202", *_ATTN_RES_MIX),
        "0.5.23": fn("srt/layers/attn_residual.py:209", *_ATTN_RES_MIX),
    },
    _S + "layers.attn_residual.aggregate_stream_torch": {
        "0.5.17": fn("srt/layers/attn_residual.py:299", *_ATTN_RES_MIX),
        "0.5.23": fn("srt/layers/attn_residual.py:318", *_ATTN_RES_MIX),
    },
    _S + "layers.attn_residual._BLOCK_H": {
        "0.5.17": attr("srt/layers/attn_residual.py:29"),
        "0.5.23": attr("srt/layers/attn_residual.py:29"),
    },
    # the attention backends in effect, read by the K3.1 class (models/kimi_k31.check_dsa_attention_backend)
    _S + "runtime_context.get_exec": {
        "0.5.17": fn("srt/runtime_context.py:1103"),
        "0.5.23": fn("srt/runtime_context.py:1318"),
    },
    # K3.1's MLA returns its output alone when next_skip_topk is None (models/kimi_k31._install_nope_indexers;
    # tests/kimi_sglang_plugin/models/test_kimi_k31.py reads the early return in both releases)
    _S + "models.deepseek_common.attention_forward_methods.forward_mla.DeepseekMLAForwardMixin.forward_absorb_core": {
        "0.5.17": fn("srt/models/deepseek_common/attention_forward_methods/forward_mla.py:839", *_ABSORB_CORE),
        "0.5.23": fn(
            "srt/models/deepseek_common/attention_forward_methods/forward_mla.py:710",
            *_ABSORB_CORE,
            "attention_output_gate",
        ),
    },
    # routed-experts capture on 0.5.17 (patches/routed_experts_capture.py; KimiLinearConfig.__init__ is above);
    # 0.5.23 has the fixes, so no row
    _S + "models.kimi_k3.KimiK3MoE.__init__": {
        "0.5.17": fn("srt/models/kimi_k3.py:357", "self", "config", "quant_config", "prefix", "layer_idx", "alt_stream")
    },
    # K3 with LoRA: the MoE front stays unmerged (patches/lora_unfused_front.py); the server arguments it reads
    _S + "models.kimi_k3.KimiK3MoE._merge_front_weights": {
        "0.5.17": fn("srt/models/kimi_k3.py:593", "self"),
        "0.5.23": fn("srt/models/kimi_k3.py:711", "self"),
    },
    _S + "runtime_context.get_server_args": {
        "0.5.17": fn("srt/runtime_context.py:1074"),
        "0.5.23": fn("srt/runtime_context.py:1289"),
    },
    # K3.1's indexer metadata through the hybrid backend on 0.5.17 (patches/hybrid_indexer_metadata.py): inherited there
    _S + "layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.get_indexer_metadata": {
        "0.5.17": fn("srt/layers/attention/base_attn_backend.py:275", "self", "layer_id", "forward_batch")
    },
    # where expected_checksums are compared (patches/checksum_refusal.py)
    _S + "managers.tp_worker.BaseTpWorker.load_lora_adapter_from_tensors": {
        "0.5.17": fn("srt/managers/tp_worker.py:235", "self", "recv_req"),
        "0.5.23": fn("srt/managers/tp_worker.py:217", "self", "recv_req"),
    },
    _S + "lora.layers.BaseLayerWithLoRA.__init__": {
        "0.5.23": fn("srt/lora/layers.py:46", "self", "base_layer", "lora_backend")
    },
    _S + "models.kimi_k3.KimiK3DeltaAttention._merge_bfa_weights": {"0.5.23": fn("srt/models/kimi_k3.py:1813", "self")},
    # ------------------------------------------------------- MoE LoRA (moe_lora.py, patches/moe_lora_marlin.py)
    _S + "lora.layers.FusedMoEWithLoRA.__init__": {
        "0.5.17": fn("srt/lora/layers.py:943", "self", "base_layer", "lora_backend"),
        "0.5.23": fn(
            "srt/lora/layers.py:1019",
            "self",
            "base_layer",
            "lora_backend",
            "experts_shared_outer_loras",
            "max_lora_rank",
        ),
    },
    _S + "lora.lora_moe_runner_marlin.MarlinLoraRunnerCore.run_from_dispatch": {
        "0.5.17": fn("srt/lora/lora_moe_runner_marlin.py:56", *_RUN_FROM_DISPATCH),
        "0.5.23": fn("srt/lora/lora_moe_runner_marlin.py:61", *_RUN_FROM_DISPATCH),
    },
    _S + "lora.backend.base_backend.BaseLoRABackend.init_cuda_graph_moe_buffers": {
        "0.5.17": fn(
            "srt/lora/backend/base_backend.py:202", "self", "max_bs", "max_loras", "compute_dtype", "moe_layer"
        )
    },
    _S + "layers.moe.moe_runner.base.MoeRunnerConfig": {
        "0.5.17": fields("srt/layers/moe/moe_runner/base.py:37", *_RUNNER_FIELDS),
        "0.5.23": fields("srt/layers/moe/moe_runner/base.py:38", *_RUNNER_FIELDS),
    },
    "sglang.kernels.ops.kimi_k3.situ_and_mul": {
        "0.5.17": fn("kernels/ops/kimi_k3/__init__.py:17", *_SITU),
        "0.5.23": ABSENT,
    },
    "sglang.kernels.ops.activation.situ_and_mul": {
        "0.5.17": ABSENT,
        "0.5.23": fn("kernels/ops/activation/__init__.py:109", *_SITU),
    },
    _S + "layers.quantization.mxfp4.Mxfp4MoEMethod": {
        "0.5.17": cls("srt/layers/quantization/mxfp4.py:326"),
        "0.5.23": cls("srt/layers/quantization/mxfp4.py:387"),
    },
    _S + "layers.quantization.mxfp4_marlin_moe.build_marlin_moe_quant_info": {
        "0.5.17": fn("srt/layers/quantization/mxfp4_marlin_moe.py:20", "layer"),
        "0.5.23": fn("srt/layers/quantization/mxfp4_marlin_moe.py:21", "layer"),
    },
    _S + "layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsFusedMoEMethod": {
        "0.5.17": cls("srt/layers/quantization/compressed_tensors/compressed_tensors.py:1069"),
        "0.5.23": cls("srt/layers/quantization/compressed_tensors/compressed_tensors.py:1341"),
    },
    # ---------------------------------------------------------------- registration, K3.1 class
    _S + "utils.hf_transformers.common._CONFIG_REGISTRY": {
        "0.5.17": attr("srt/utils/hf_transformers/common.py:85"),
        "0.5.23": attr("srt/utils/hf_transformers/common.py:117"),
    },
    _S + "configs.kimi_k3.KimiK3Config": {
        "0.5.17": cls("srt/configs/kimi_k3.py:79"),
        "0.5.23": cls("srt/configs/kimi_k3.py:79"),
    },
    _S + "models.kimi_k3.KimiK3ForConditionalGeneration.__init__": {
        "0.5.17": fn("srt/models/kimi_k3.py:2951", "self", "config", "quant_config", "prefix", "**kwargs"),
        "0.5.23": fn("srt/models/kimi_k3.py:3485", "self", "config", "quant_config", "prefix", "**kwargs"),
    },
    _S + "layers.attention.dsa.dsa_indexer.Indexer": {
        "0.5.17": cls("srt/layers/attention/dsa/dsa_indexer.py:200"),
        "0.5.23": cls("srt/layers/attention/dsa/dsa_indexer.py:267"),
    },
}


def symbols_for(release: str) -> list[str]:
    """The symbols that have a row for ``release``."""
    return [s for s, rows in FACTS.items() if release in rows]


def _resolve(symbol: str):
    obj_path, name = symbol.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), name)


def _param_names(obj) -> tuple[str, ...]:
    # inspect.signature follows __wrapped__, so a target already hooked still shows its own parameters
    out = []
    for p in inspect.signature(obj).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return tuple(out)


def live_fact(symbol: str, expect: Fact | None = None) -> Fact:
    """What the importable SGLang has at ``symbol`` (``where`` empty). ``expect`` picks how a class
    is described (``fields`` rows list the dataclass fields that ``expect`` names, when present)."""
    try:
        obj = _resolve(symbol)
    except (ImportError, AttributeError, ValueError):
        return ABSENT
    if isinstance(obj, type):
        if expect is not None and expect.kind == "fields" and dataclasses.is_dataclass(obj):
            have = {f.name for f in dataclasses.fields(obj)}
            return Fact("", "fields", tuple(n for n in expect.params if n in have))
        return Fact("", "class")
    if callable(obj):
        try:
            return Fact("", "function", _param_names(obj))
        except (TypeError, ValueError):
            return Fact("", "attr")
    return Fact("", "attr")


def compare(symbol: str, release: str) -> str | None:
    """``None`` when the importable SGLang matches the ``release`` row of ``symbol``; else the difference."""
    want = FACTS.get(symbol, {}).get(release)
    if want is None:
        return f"{symbol}: no recorded facts for SGLang {release}"
    got = live_fact(symbol, want)
    if got.kind == want.kind and got.params == want.params:
        return None
    at = f" (SGLang {release} has it at sglang/{want.where})" if want.where else ""
    if want.kind == "absent":
        return f"{symbol}: present here, absent in SGLang {release}"
    if got.kind == "absent":
        return f"{symbol}: missing{at}"
    if want.kind == "fields":
        return f"{symbol}: dataclass fields {sorted(set(want.params) - set(got.params))} missing{at}"
    if want.kind == got.kind == "function":
        return f"{symbol}: signature ({', '.join(got.params)}) differs from ({', '.join(want.params)}){at}"
    return f"{symbol}: a {got.kind}, expected a {want.kind}{at}"


def check_release(release: str, symbols=None) -> list[str]:
    """Every difference between the importable SGLang and the ``release`` rows (all rows, or ``symbols``)."""
    out = []
    for s in symbols_for(release) if symbols is None else symbols:
        problem = compare(s, release)
        if problem:
            out.append(problem)
    return out


# ---------------------------------------------------------------------------------------- refusal stand-ins
#: the architectures the plugin changes (K2.x runs stock SGLang code and is never refused)
REFUSED_ARCHS = (K3, K3_LINEAR, K31)


def refusal_class(arch: str, message: str) -> type:
    """An ``nn.Module`` class named ``arch`` whose construction raises ``PluginError(message)``."""
    import torch

    def __init__(self, *args, **kwargs):
        raise PluginError(message)

    return type(
        arch,
        (torch.nn.Module,),
        {"__init__": __init__, "__doc__": message, "kimi_refusal": message, "__module__": __name__},
    )


def _register_k31_config() -> None:
    """K3.1's config must load for its architecture (and so the refusal) to be reached."""
    from kimi_sglang_plugin.registration import register_config

    try:
        register_config()
    except Exception:  # noqa: BLE001 - SGLang's loader must never see a plugin error
        logger.warning("kimi_sglang_plugin: model_type kimi_k31 not registered", exc_info=True)


def refuse(message: str, archs=REFUSED_ARCHS) -> list[str]:
    """Log ``message`` and register a refusal class under each of ``archs``; returns the archs done.

    Never raises: a failure here is logged and the remaining architectures are still tried.
    """
    logger.error("%s", message)
    _register_k31_config()
    done = []
    try:
        from sglang.srt.models.registry import ModelRegistry
    except Exception:
        logger.exception("kimi_sglang_plugin: SGLang's model registry did not import; Kimi models not refused")
        return done
    for arch in archs:
        try:
            ModelRegistry.models[arch] = refusal_class(arch, message)
            done.append(arch)
        except Exception:
            logger.exception("kimi_sglang_plugin: could not register the refusal for %s", arch)
    return done
