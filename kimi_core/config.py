"""Typed configs of Kimi K2.x, K3 and K3.1 parsed from a Hugging Face ``config.json``.

One exact definition shared by every plugin. Field names are the HF ones (see
``docs/models.md``): K2.x is the DeepSeek-V3 architecture (``n_routed_experts``,
``num_experts_per_tok``...), K3 is ``KimiK3ForConditionalGeneration`` whose ``text_config`` has
``model_type: kimi_linear`` and K3 names (``num_experts``, ``num_experts_per_token``...). K3.1 is
K3 plus the DSA lightning indexer fields ``index_n_heads``, ``index_head_dim``, ``index_topk``
(K3.1 field names are inferred from DeepSeek-V3.2; no public K3.1 config exists).

:class:`KimiConfig` normalises both namings into one set of attributes; ``text`` keeps the raw
text-config dict so nothing is lost when a config is written back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from kimi_core.architectures import FAMILIES, K2_ALIAS
from kimi_core.errors import KimiError
from kimi_core.json_file import read_json_file
from kimi_core.quant.formats import INT4, MXFP4

__all__ = [
    "ConfigError",
    "KimiConfig",
    "LinearAttnConfig",
    "QuantSpec",
    "load_config",
    "FAMILIES",
]

_ARCH_TO_FAMILY = {v: k for k, v in FAMILIES.items()}
_ARCH_TO_FAMILY[K2_ALIAS] = "k2"

INT4_FORMAT = INT4.name
MXFP4_FORMAT = MXFP4.name


class ConfigError(KimiError, ValueError):
    """A config field is missing, has the wrong type or is inconsistent with another field."""


@dataclass(frozen=True)
class QuantSpec:
    """The routed-expert weight format declared by ``quantization_config`` (compressed-tensors).

    :param format: ``"pack-quantized"`` (INT4, K2.x) or ``"mxfp4-pack-quantized"`` (MXFP4, K3/K3.1).
    :param group_size: elements per scale along the input dimension (32 for both Kimi formats).
    :param ignore: module-name patterns left unquantized (``re:`` prefix = regex), as in the HF config.
    """

    format: str
    group_size: int = 32
    num_bits: int = 4
    ignore: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_hf(cls, qc: dict, where: str) -> QuantSpec:
        if qc.get("quant_method") != "compressed-tensors":
            raise ConfigError(
                f"{where}: quantization_config.quant_method={qc.get('quant_method')!r}; only "
                "'compressed-tensors' (INT4 pack-quantized or MXFP4 mxfp4-pack-quantized) is supported"
            )
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        weights = {}
        for g in groups.values():
            weights = g.get("weights") or {}
            fmt = g.get("format", fmt)
            break
        if fmt not in (INT4_FORMAT, MXFP4_FORMAT):
            raise ConfigError(
                f"{where}: quantization_config.format={fmt!r}; expected {INT4_FORMAT!r} or {MXFP4_FORMAT!r}"
            )
        num_bits = int(weights.get("num_bits", 4))
        group_size = int(weights.get("group_size", 32))
        if num_bits != 4:
            raise ConfigError(f"{where}: quantization_config weights.num_bits={num_bits}; only 4 is supported")
        if group_size != 32:
            raise ConfigError(f"{where}: quantization_config weights.group_size={group_size}; only 32 is supported")
        want_type = "float" if fmt == MXFP4_FORMAT else "int"
        if weights.get("type", want_type) != want_type:
            raise ConfigError(
                f"{where}: quantization_config weights.type={weights.get('type')!r} contradicts format {fmt!r}"
            )
        return cls(format=fmt, group_size=group_size, num_bits=num_bits, ignore=tuple(qc.get("ignore") or ()), raw=qc)

    def to_hf(self) -> dict:
        if self.raw:
            return self.raw
        is_fp = self.format == MXFP4_FORMAT
        weights = {
            "num_bits": 4,
            "type": "float" if is_fp else "int",
            "strategy": "group",
            "group_size": self.group_size,
            "symmetric": True,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        if is_fp:
            weights["scale_dtype"] = "torch.uint8"
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": self.format,
                }
            },
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }


@dataclass(frozen=True)
class LinearAttnConfig:
    """``text_config.linear_attn_config`` of K3 / Kimi-Linear. Layer lists are **1-based** on disk."""

    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0 (sigmoid "safe" gate); None = Kimi-Linear softplus gate
    use_full_rank_gate: bool = False  # K3: g_proj [P, H]; Kimi-Linear: g_a_proj/g_b_proj


def _req(d: dict, key: str, where: str, typ=(int,)):
    if key not in d:
        raise ConfigError(f"{where}: missing required field {key!r}")
    v = d[key]
    if typ and not isinstance(v, typ) or isinstance(v, bool) and bool not in typ:
        raise ConfigError(f"{where}: field {key!r} must be {'/'.join(t.__name__ for t in typ)}, got {v!r}")
    return v


def _first(d: dict, keys: tuple[str, ...], where: str, default=dataclasses.MISSING):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    if default is dataclasses.MISSING:
        raise ConfigError(f"{where}: missing required field {' or '.join(repr(k) for k in keys)}")
    return default


@dataclass(frozen=True)
class KimiConfig:
    """Normalised Kimi text-model config.

    Attribute names follow the DeepSeek-V3 HF names where both namings exist; ``from_hf`` reads
    the K3 names (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
    ``moe_renormalize``, ``moe_router_activation_func``, ``num_expert_group``) as well.
    Layer indices in methods are **0-based**.
    """

    family: str  # "k2" | "k25" | "k3" | "k31"
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    # MLPs
    hidden_act: str
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    # K3 latent MoE / SiTU / attention residuals / KDA
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int | None = None
    linear_attn: LinearAttnConfig | None = None
    # K3.1 DSA lightning indexer
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    quant: QuantSpec | None = None
    top: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    text: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ------------------------------------------------------------------ derived facts
    @property
    def is_k3_family(self) -> bool:
        return self.family in ("k3", "k31")

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def lm_prefix(self) -> str:
        """Prefix of the language model's weights: ``""`` for K2 text, ``"language_model."`` otherwise."""
        return "" if self.family == "k2" else "language_model."

    @property
    def moe_prefix(self) -> str:
        """Sub-module holding the MoE in a layer: ``mlp`` (K2.x) or ``block_sparse_moe`` (K3)."""
        return "block_sparse_moe" if self.is_k3_family else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """HF names of (gate, up, down) inside ``experts.{e}``."""
        return ("w1", "w3", "w2") if self.is_k3_family else ("gate_proj", "up_proj", "down_proj")

    @property
    def expert_in_size(self) -> int:
        """Width the routed experts read and write: the latent size for K3, ``hidden_size`` for K2."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_kda_layer(self, layer: int) -> bool:
        """True if 0-based ``layer`` uses KDA (linear attention) rather than MLA."""
        return self.linear_attn is not None and (layer + 1) in self.linear_attn.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    def layer_prefix(self, layer: int) -> str:
        return f"{self.lm_prefix}model.layers.{layer}."

    def num_attn_res_snapshots(self, num_layers: int | None = None) -> int:
        """Snapshots the residual bank holds after ``num_layers`` layers: ``ceil(L / block)``."""
        n = self.num_hidden_layers if num_layers is None else num_layers
        b = self.attn_res_block_size
        return 0 if not b else -(-n // b)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> KimiConfig:
        """Parse a HF config dict. Raises :class:`ConfigError` naming the offending field."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        family = _ARCH_TO_FAMILY.get(arch)
        if family is None:
            raise ConfigError(
                f"{where}: architectures={archs!r} is not a Kimi model; expected one of {sorted(_ARCH_TO_FAMILY)}"
            )
        if family == "k2" and cfg.get("model_type") not in ("kimi_k2", "deepseek_v3"):
            raise ConfigError(f"{where}: model_type={cfg.get('model_type')!r}; a K2 text config has 'kimi_k2'")
        nested = family != "k2"
        text = cfg.get("text_config") if nested else cfg
        tw = f"{where}: text_config" if nested else where
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: missing required field 'text_config' for {arch}")
        if family in ("k3", "k31") and text.get("model_type") != "kimi_linear":
            raise ConfigError(f"{tw}.model_type={text.get('model_type')!r}; K3 text configs have 'kimi_linear'")

        g = lambda keys, default=dataclasses.MISSING: _first(text, keys, tw, default)
        kw: dict[str, Any] = dict(
            family=family,
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            vocab_size=_req(text, "vocab_size", tw),
            hidden_size=_req(text, "hidden_size", tw),
            num_hidden_layers=_req(text, "num_hidden_layers", tw),
            rms_norm_eps=float(g(("rms_norm_eps",), 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            num_attention_heads=_req(text, "num_attention_heads", tw),
            q_lora_rank=text.get("q_lora_rank"),
            kv_lora_rank=_req(text, "kv_lora_rank", tw),
            qk_nope_head_dim=_req(text, "qk_nope_head_dim", tw),
            qk_rope_head_dim=_req(text, "qk_rope_head_dim", tw),
            v_head_dim=_req(text, "v_head_dim", tw),
            mla_use_nope=bool(text.get("mla_use_nope", False)),
            mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
            rope_theta=float(text.get("rope_theta", 10000.0)),
            rope_scaling=text.get("rope_scaling"),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            hidden_act=str(text.get("hidden_act", "silu")),
            intermediate_size=_req(text, "intermediate_size", tw),
            first_k_dense_replace=int(text.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(text.get("moe_layer_freq", 1)),
            n_routed_experts=int(g(("n_routed_experts", "num_experts"))),
            num_experts_per_tok=int(g(("num_experts_per_tok", "num_experts_per_token"))),
            n_shared_experts=int(g(("n_shared_experts", "num_shared_experts"), 0)),
            moe_intermediate_size=int(g(("moe_intermediate_size",))),
            norm_topk_prob=bool(g(("norm_topk_prob", "moe_renormalize"), True)),
            scoring_func=str(g(("scoring_func", "moe_router_activation_func"), "sigmoid")),
            topk_method=str(text.get("topk_method", "noaux_tc")),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            n_group=int(g(("n_group", "num_expert_group"), 1)),
            topk_group=int(g(("topk_group",), 1)),
            routed_expert_hidden_size=text.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
            activation_situ_beta=float(text.get("activation_situ_beta", 4.0)),
            activation_situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
            attn_res_block_size=text.get("attn_res_block_size"),
            index_n_heads=text.get("index_n_heads"),
            index_head_dim=text.get("index_head_dim"),
            index_topk=text.get("index_topk"),
            top=cfg,
            text=text,
        )
        lac = text.get("linear_attn_config")
        if lac is not None:
            lw = f"{tw}.linear_attn_config"
            kw["linear_attn"] = LinearAttnConfig(
                kda_layers=tuple(_req(lac, "kda_layers", lw, (list,))),
                full_attn_layers=tuple(_req(lac, "full_attn_layers", lw, (list,))),
                num_heads=_req(lac, "num_heads", lw),
                head_dim=_req(lac, "head_dim", lw),
                short_conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
                gate_lower_bound=lac.get("gate_lower_bound"),
                use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            )
        qc = cfg.get("quantization_config") or text.get("quantization_config")
        if qc is not None:
            kw["quant"] = QuantSpec.from_hf(qc, f"{where}: quantization_config")
        out = cls(**kw)
        out._validate(tw)
        return out

    def _validate(self, tw: str) -> None:
        def bad(field_name: str, msg: str):
            raise ConfigError(f"{tw}.{field_name}: {msg}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", f"{self.num_experts_per_tok} > number of experts {self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            bad("n_group", f"{self.n_group} does not divide {self.n_routed_experts} experts")
        if self.topk_group > self.n_group:
            bad("topk_group", f"{self.topk_group} > n_group {self.n_group}")
        if self.scoring_func not in ("sigmoid", "softmax"):
            bad("scoring_func", f"{self.scoring_func!r} not in ('sigmoid', 'softmax')")
        if self.moe_layer_freq < 1:
            bad("moe_layer_freq", "must be >= 1")
        if self.is_k3_family:
            if self.hidden_act != "situ":
                bad("hidden_act", f"K3 uses 'situ', got {self.hidden_act!r}")
            if self.linear_attn is None:
                bad("linear_attn_config", "missing; K3 needs kda_layers / full_attn_layers")
            if not self.attn_res_block_size or self.attn_res_block_size < 1:
                bad("attn_res_block_size", f"must be a positive int, got {self.attn_res_block_size!r}")
            if not self.routed_expert_hidden_size:
                bad("routed_expert_hidden_size", "missing; K3's latent MoE needs it")
            la = self.linear_attn
            L = self.num_hidden_layers
            both = set(la.kda_layers) & set(la.full_attn_layers)
            if both:
                bad("linear_attn_config.kda_layers", f"layers {sorted(both)} are also in full_attn_layers")
            allset = set(la.kda_layers) | set(la.full_attn_layers)
            if allset != set(range(1, L + 1)):
                missing = sorted(set(range(1, L + 1)) - allset)
                extra = sorted(allset - set(range(1, L + 1)))
                bad(
                    "linear_attn_config",
                    f"kda_layers + full_attn_layers must cover 1..{L} (1-based) exactly; missing {missing}, out of range {extra}",
                )
            if la.num_heads > la.head_dim and self.family != "k3":
                pass  # A_log padding is to head_dim; nothing to check for tiny configs
        if self.family == "k31":
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                    bad(name, f"K3.1 needs a positive int, got {getattr(self, name)!r}")
            if self.q_lora_rank is None:
                bad("q_lora_rank", "K3.1's indexer reads the MLA query latent; q_lora_rank is required")
        if self.quant is not None:
            want = MXFP4.name if self.is_k3_family else INT4.name
            if self.quant.format != want:
                raise ConfigError(
                    f"{tw}: quantization_config.format={self.quant.format!r}, but {self.architecture} experts are {want!r}"
                )

    def to_hf(self) -> dict:
        """The full HF config dict this was parsed from (round-trips ``from_hf``)."""
        return json.loads(json.dumps(self.top))


def load_config(path: str | os.PathLike) -> KimiConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p, cfg = read_json_file(path, "config.json", ConfigError, "no config.json found")
    return KimiConfig.from_hf(cfg, where=p)
