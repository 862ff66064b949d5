"""What a Kimi LoRA adapter is (:class:`LoraSpec`) and its PEFT ``adapter_config.json``.

The spec is the training-side description (rank, alpha, targets, expert layout, capacity
normalisation). :meth:`LoraSpec.to_adapter_config` writes the PEFT dict that vLLM, SGLang and
PEFT read; :meth:`LoraSpec.from_adapter_config` reads one back.

Rank and scaling per module follow PEFT's rules: ``r`` / ``lora_alpha`` unless a
``rank_pattern`` / ``alpha_pattern`` key matches the module name (without ``base_model.model.``)
as ``re.match(rf"(.*\\.)?({key})$", name)``, first key wins (huggingface/peft
``get_pattern_key``; vLLM ``PEFTHelper.get_rank_and_scaling`` uses the same rule and, for the
stacked MoE form, matches ``...experts.base_layer`` as ``...experts.gate_up_proj`` and
``...experts`` as ``...experts.down_proj``). Scaling is ``alpha / r`` (``alpha / sqrt(r)`` with
``use_rslora``).

Capacity-normalised experts (SkyRL ``normalize_moe_lora``, Megatron-Bridge PR #3006): routed
experts get rank ``rank // top_k`` (must divide), every other module keeps ``rank``. Expert
alpha defaults to ``alpha`` (Megatron's adapter scale is ``alpha / dim`` with the reduced dim);
both go to ``rank_pattern`` / ``alpha_pattern`` so any PEFT-rule reader gets the scaling right.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kimi_core.errors import KimiError
from kimi_core.json_file import read_json_file

if TYPE_CHECKING:
    from kimi_core.config import KimiConfig

__all__ = [
    "AdapterConfigError",
    "EXPERT_LAYOUTS",
    "FILE_LAYOUTS",
    "LoraSpec",
    "ALL_LINEAR",
    "pattern_value",
    "module_rank_alpha",
    "scaling_for",
    "write_adapter_config",
    "read_adapter_config",
    "META_KEY",
]

#: training-side parameterisation of routed experts
EXPERT_LAYOUTS = ("per_expert", "shared_outer")
#: on-disk / on-wire forms (see :mod:`kimi_core.lora.layouts`)
FILE_LAYOUTS = ("per_expert", "per_expert_3d", "shared_outer", "stacked")
#: ``target_modules`` value meaning every LoRA-able linear of the model except the DSA indexer
ALL_LINEAR = "all-linear"
#: our extra metadata in adapter_config.json (PEFT and vLLM ignore unknown keys)
META_KEY = "kimi_rl"


class AdapterConfigError(KimiError, ValueError):
    """An adapter config or spec is invalid; the message names the file and the field."""


@dataclass(frozen=True)
class LoraSpec:
    """A Kimi LoRA adapter description.

    :param rank: LoRA rank ``r`` of every targeted module (experts: see ``normalize_moe_lora``).
    :param alpha: ``lora_alpha``; scaling is ``alpha / r``.
    :param target_modules: ``"all-linear"``, a list of module-name suffixes (``"q_a_proj"``,
        ``"shared_experts.gate_proj"``, ``"w1"``...; matched at a ``.`` boundary, as PEFT does) or
        one regex string that must match the whole module name (PEFT's ``str`` form).
    :param exclude_modules: same forms; matching modules are dropped (PEFT ``exclude_modules``).
    :param expert_layout: ``"per_expert"`` (every expert owns A and B) or ``"shared_outer"``
        (SGLang ``--experts-shared-outer-loras``: gate/up share one A per layer, down shares one B).
    :param normalize_moe_lora: routed experts use rank ``rank // top_k``; it must divide.
    :param expert_alpha: alpha of routed experts when normalised (``None``: ``alpha``).
    :param base_model_name_or_path: the release the adapter applies to (the 4-bit checkpoint).
    :param use_rslora: scaling ``alpha / sqrt(r)`` instead of ``alpha / r``.
    """

    rank: int = 32
    alpha: float = 32.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    exclude_modules: tuple[str, ...] | str = ()
    expert_layout: str = "per_expert"
    normalize_moe_lora: bool = False
    expert_alpha: float | None = None
    base_model_name_or_path: str = ""
    use_rslora: bool = False

    def __post_init__(self):
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.exclude_modules, list):
            object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise AdapterConfigError(f"LoraSpec.rank must be a positive int, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise AdapterConfigError(f"LoraSpec.alpha must be positive, got {self.alpha!r}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise AdapterConfigError(f"LoraSpec.expert_layout={self.expert_layout!r}; expected one of {EXPERT_LAYOUTS}")
        if self.expert_alpha is not None and not self.expert_alpha > 0:
            raise AdapterConfigError(f"LoraSpec.expert_alpha must be positive, got {self.expert_alpha!r}")

    # ------------------------------------------------------------------ ranks
    def expert_rank(self, top_k: int) -> int:
        """Rank of routed experts: ``rank`` or, with ``normalize_moe_lora``, ``rank // top_k``."""
        if not self.normalize_moe_lora:
            return self.rank
        if top_k <= 0 or self.rank % top_k:
            raise AdapterConfigError(
                f"normalize_moe_lora: rank {self.rank} is not divisible by the router top-k {top_k} "
                f"(num_experts_per_tok); pick a rank that is a multiple of {top_k}"
            )
        return self.rank // top_k

    def expert_alpha_value(self) -> float:
        return float(self.alpha if self.expert_alpha is None else self.expert_alpha)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    # ------------------------------------------------------------------ PEFT dict
    def to_adapter_config(
        self, config: KimiConfig, layout: str | None = None, target_names: list[str] | None = None
    ) -> dict:
        """The PEFT ``adapter_config.json`` dict for ``config`` (a ``KimiConfig``) in file ``layout``.

        :param layout: one of :data:`FILE_LAYOUTS` (default: ``expert_layout``).
        :param target_names: leaf names to write as ``target_modules`` (default: the leaves this
            spec selects on ``config``, from :func:`kimi_core.lora.naming.selected_leaves`).
        """
        from kimi_core.lora.naming import expert_pattern_keys, selected_leaves

        layout = layout or self.expert_layout
        if layout not in FILE_LAYOUTS:
            raise AdapterConfigError(f"layout={layout!r}; expected one of {FILE_LAYOUTS}")
        leaves = sorted(target_names if target_names is not None else selected_leaves(config, self))
        r_e = self.expert_rank(config.num_experts_per_tok)
        a_e = self.expert_alpha_value()
        rank_pattern: dict[str, int] = {}
        alpha_pattern: dict[str, float] = {}
        has_experts = any(leaf in config.expert_names for leaf in leaves)
        if has_experts and (r_e != self.rank or a_e != self.alpha):
            for key in expert_pattern_keys(config, layout).values():
                rank_pattern[key] = r_e
                alpha_pattern[key] = a_e
        target_parameters = None
        if layout == "stacked" and has_experts:
            leaves = [leaf for leaf in leaves if leaf not in config.expert_names]
            target_parameters = ["experts.gate_up_proj", "experts.down_proj"]
        out: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": leaves,
            "exclude_modules": (
                list(self.exclude_modules) if not isinstance(self.exclude_modules, str) else self.exclude_modules
            )
            or None,
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "modules_to_save": None,
            "init_lora_weights": True,
            "layers_to_transform": None,
            "layers_pattern": None,
            "inference_mode": True,
            "revision": None,
            META_KEY: {
                "expert_layout": self.expert_layout,
                "file_layout": layout,
                "normalize_moe_lora": self.normalize_moe_lora,
                "expert_rank": r_e,
                "spec_target_modules": (
                    self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
                ),
                "num_experts": config.n_routed_experts,
                "family": config.family,
            },
        }
        if target_parameters is not None:
            out["target_parameters"] = target_parameters
        return out

    @classmethod
    def from_adapter_config(cls, d: dict, where: str = "adapter_config.json") -> LoraSpec:
        """Read a spec back from a PEFT dict (ours or anyone's; our ``kimi_rl`` block is optional)."""
        validate_adapter_config(d, where)
        meta = d.get(META_KEY) or {}
        tm = meta.get("spec_target_modules", d.get("target_modules") or ALL_LINEAR)
        excl = d.get("exclude_modules") or ()
        expert_alpha = None
        if meta.get("normalize_moe_lora") and d.get("alpha_pattern"):
            vals = set(d["alpha_pattern"].values())
            if len(vals) == 1:
                expert_alpha = float(vals.pop())
        return cls(
            rank=int(d["r"]),
            alpha=float(d["lora_alpha"]),
            target_modules=tm if isinstance(tm, str) else tuple(tm),
            exclude_modules=excl if isinstance(excl, str) else tuple(excl),
            expert_layout=meta.get("expert_layout", "per_expert"),
            normalize_moe_lora=bool(meta.get("normalize_moe_lora", False)),
            expert_alpha=expert_alpha if expert_alpha != float(d["lora_alpha"]) else None,
            base_model_name_or_path=d.get("base_model_name_or_path") or "",
            use_rslora=bool(d.get("use_rslora", False)),
        )


def validate_adapter_config(d: dict, where: str = "adapter_config.json") -> None:
    """Reject what none of our consumers can serve; errors name ``where`` and the field."""
    if not isinstance(d, dict):
        raise AdapterConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if str(d.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterConfigError(f"{where}: peft_type={d.get('peft_type')!r}; only 'LORA' is supported")
    for key in ("r", "lora_alpha"):
        if key not in d:
            raise AdapterConfigError(f"{where}: missing required field {key!r}")
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise AdapterConfigError(f"{where}: field {key!r} must be a positive number, got {v!r}")
    if d.get("use_dora"):
        raise AdapterConfigError(f"{where}: use_dora=true; DoRA is not supported (vLLM rejects it too)")
    if d.get("bias", "none") != "none":
        raise AdapterConfigError(f"{where}: bias={d.get('bias')!r}; only 'none' is supported")
    if d.get("fan_in_fan_out"):
        raise AdapterConfigError(f"{where}: fan_in_fan_out=true is not supported (Kimi linears are [out, in])")
    for key in ("rank_pattern", "alpha_pattern"):
        pat = d.get(key) or {}
        if not isinstance(pat, dict):
            raise AdapterConfigError(f"{where}: {key} must be an object, got {type(pat).__name__}")
        for k, v in pat.items():
            try:
                re.compile(k)
            except re.error as e:
                raise AdapterConfigError(f"{where}: {key} key {k!r} is not a valid regex ({e})") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise AdapterConfigError(f"{where}: {key}[{k!r}] must be a positive number, got {v!r}")


def pattern_value(pattern: dict | None, module: str):
    """PEFT's pattern lookup: the value of the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def module_rank_alpha(adapter_config: dict, module: str) -> tuple[int, float]:
    """``(r, alpha)`` PEFT assigns to ``module`` (name without ``base_model.model.``)."""
    r = pattern_value(adapter_config.get("rank_pattern"), module)
    a = pattern_value(adapter_config.get("alpha_pattern"), module)
    return int(r if r is not None else adapter_config["r"]), float(a if a is not None else adapter_config["lora_alpha"])


def scaling_for(adapter_config: dict, rank: int, alpha: float) -> float:
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def write_adapter_config(d: dict, directory: str | os.PathLike) -> str:
    """Write ``adapter_config.json`` into ``directory`` atomically (temp name, then ``os.replace``)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.fspath(directory), "adapter_config.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """Read and validate ``adapter_config.json`` from an adapter directory (or the file itself)."""
    p, d = read_json_file(
        directory,
        "adapter_config.json",
        AdapterConfigError,
        "file not found (a PEFT adapter directory needs adapter_config.json)",
    )
    validate_adapter_config(d, p)
    return d
