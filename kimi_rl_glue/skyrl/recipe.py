"""The Kimi K2.x SkyRL recipe (seed 003: SkyRL, K2.x INT4 QAT LoRA; ``docs/recipes/kimi_k2_int4_qat_lora.md``) as one validated object.

vLLM serves the INT4 release as-is (``trainer.policy.model.path``); the Megatron trainer loads BF16
masters dequantized from it (``fake_int4_qat.bf16_base_path``, written by ``kimi-rl dequantize``) and
fake-quantizes the frozen expert GEMMs back onto the same INT4 grid (``fake_int4_qat``); LoRA is
never merged (``merge_lora=false``: the adapter is hot-loaded into vLLM after every step);
expert adapters get ``rank // moe_router_topk`` (``normalize_moe_lora``); only the text model is
built on both sides (``language_model_only``). TIS (token) corrects the remaining mismatch.

:meth:`K2xRecipe.overrides` returns SkyRL dotlist overrides; our plugins come in through
``trainer.override_entrypoint=kimi_rl_glue.skyrl.main`` (losses, DAPO reward shaping) and the
``vllm.general_plugins`` entry point ``kimi`` (Kimi classes with LoRA in the engine, see
:meth:`K2xRecipe.env`). ``normalize_moe_lora`` is our key (``trainer.policy.model.kimi.normalize_moe_lora``,
read by :mod:`kimi_rl_glue.skyrl.worker`): SkyRL's own exists only in some releases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kimi_core.errors import KimiError

__all__ = ["CONVENTIONS", "RecipeError", "K2xRecipe"]

# convention -> (scale_divisor, q_min) of the served INT4 grid
CONVENTIONS = {"kimi": (7.0, -7), "rtn": (7.5, -8)}


class RecipeError(KimiError, ValueError):
    """An inconsistent recipe setting; the message names the SkyRL key."""


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(f"'{x}'" for x in v) + "]"
    return str(v)


@dataclass
class K2xRecipe:
    """Settings of the K2.x LoRA + fake-INT4 QAT + DAPO recipe (defaults: the seed's 2x8 B300 run).

    :param model_path: the INT4 release served by vLLM (``trainer.policy.model.path``).
    :param bf16_base_path: BF16 masters for the trainer (required with ``qat``).
    :param moe_router_topk: ``num_experts_per_tok`` of the model (read by :meth:`from_checkpoint`).
    :param convention: ``"kimi"`` (scale = amax/7, q in [-7, 7]; dequantized masters are a fixed point)
        or ``"rtn"`` (amax/7.5, q in [-8, 7]; use the original BF16 release as masters).
    """

    model_path: str
    bf16_base_path: str | None = None
    lora_rank: int = 32
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = ("linear_proj", "linear_fc1", "linear_fc2")
    qat: bool = True
    convention: str = "kimi"
    group_size: int = 32
    normalize_moe_lora: bool = True
    moe_router_topk: int | None = None
    language_model_only: bool = True
    policy_loss_type: str = "kimi_dapo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    clip_ratio_c: float = 10.0
    loss_reduction: str = "token_mean"
    tis_ratio_type: str | None = "token"
    token_tis_ratio_clip_high: float = 2.0
    overlong_buffer_len: int = 4096
    overlong_buffer_penalty_factor: float = 1.0

    @classmethod
    def from_checkpoint(cls, model_path: str, **kw) -> K2xRecipe:
        """Fill ``moe_router_topk`` and check the expert format from ``<model_path>/config.json``.

        :raises RecipeError: the checkpoint is not a K2.x INT4 ``pack-quantized`` release.
        """
        from kimi_core.config import INT4_FORMAT, load_config

        cfg = load_config(model_path)
        if cfg.is_k3_family:
            raise RecipeError(f"{model_path}: {cfg.family} is a K3-family model; the K2.x SkyRL recipe needs K2/K2.5")
        if cfg.quant is None or cfg.quant.format != INT4_FORMAT:
            have = None if cfg.quant is None else cfg.quant.format
            raise RecipeError(
                f"{model_path}: experts are {have!r}, the recipe serves INT4 {INT4_FORMAT!r} "
                "(trainer.policy.model.fake_int4_qat)"
            )
        kw.setdefault("group_size", cfg.quant.group_size)
        return cls(model_path=model_path, moe_router_topk=cfg.num_experts_per_tok, **kw)

    def validate(self) -> None:
        """Raise :class:`RecipeError` on the combinations SkyRL or the Kimi formats reject."""
        if self.convention not in CONVENTIONS:
            raise RecipeError(f"fake_int4_qat convention={self.convention!r}; expected one of {tuple(CONVENTIONS)}")
        if self.lora_rank <= 0:
            raise RecipeError(
                "trainer.policy.model.lora.rank must be > 0: the recipe syncs only the adapter "
                "(merge_lora=false) and fake_int4_qat requires LoRA"
            )
        if self.qat and not self.bf16_base_path:
            raise RecipeError(
                "trainer.policy.model.fake_int4_qat.bf16_base_path is required with QAT: "
                "Megatron-Bridge cannot load the INT4 release; write masters with `kimi-rl dequantize`"
            )
        if self.group_size != 32:
            raise RecipeError(f"trainer.policy.model.fake_int4_qat.group_size={self.group_size}; Kimi INT4 uses 32")
        if self.normalize_moe_lora:
            if not self.moe_router_topk:
                raise RecipeError(
                    "normalize_moe_lora needs moe_router_topk (num_experts_per_tok); "
                    "use K2xRecipe.from_checkpoint(model_path)"
                )
            if self.lora_rank % self.moe_router_topk:
                raise RecipeError(
                    f"trainer.policy.model.kimi.normalize_moe_lora: lora.rank "
                    f"{self.lora_rank} must be divisible by moe_router_topk {self.moe_router_topk}"
                )
        if self.tis_ratio_type not in (None, "token", "sequence"):
            raise RecipeError(f"trainer.algorithm.off_policy_correction.tis_ratio_type={self.tis_ratio_type!r}")
        if self.clip_ratio_c <= 1:
            raise RecipeError(f"trainer.algorithm.clip_ratio_c={self.clip_ratio_c} must be > 1")

    @property
    def expert_lora_rank(self) -> int:
        """Rank of each routed expert's adapter (``rank // topk`` with ``normalize_moe_lora``)."""
        if self.normalize_moe_lora and self.moe_router_topk:
            return self.lora_rank // self.moe_router_topk
        return self.lora_rank

    def overrides(self) -> list[str]:
        """SkyRL ``key=value`` overrides (validated first)."""
        self.validate()
        sd, qmin = CONVENTIONS[self.convention]
        o = {
            "trainer.override_entrypoint": "kimi_rl_glue.skyrl.main",
            "trainer.strategy": "megatron",
            "trainer.flash_attn": False,  # MLA + sample packing needs TE cuDNN fused attention
            "trainer.policy.model.path": self.model_path,
            "trainer.policy.model.lora.rank": self.lora_rank,
            "trainer.policy.model.lora.alpha": self.lora_alpha,
            "trainer.policy.model.lora.target_modules": list(self.target_modules),
            # our config extension (kimi_rl_glue.skyrl.config): QAT trains BF16 masters, else the packed INT4
            # experts stay in the trainer; check_config() refuses any other pairing with fake_int4_qat
            "trainer.policy.model.kimi.expert_weights": "bf16" if self.qat else "int4",
            "trainer.policy.megatron_config.lora_config.merge_lora": False,
            "trainer.policy.model.kimi.normalize_moe_lora": self.normalize_moe_lora,
            "trainer.policy.language_model_only": self.language_model_only,
            "generator.inference_engine.language_model_only": self.language_model_only,
            "trainer.algorithm.policy_loss_type": self.policy_loss_type,
            "trainer.algorithm.eps_clip_low": self.eps_clip_low,
            "trainer.algorithm.eps_clip_high": self.eps_clip_high,
            "trainer.algorithm.clip_ratio_c": self.clip_ratio_c,
            "trainer.algorithm.loss_reduction": self.loss_reduction,
            "trainer.algorithm.use_kl_loss": False,
            "trainer.algorithm.overlong_buffer_len": self.overlong_buffer_len,
            "trainer.algorithm.overlong_buffer_penalty_factor": self.overlong_buffer_penalty_factor,
            "generator.apply_overlong_filtering": False,
        }
        if self.qat:
            o.update(
                {
                    "trainer.policy.model.fake_int4_qat.enabled": True,
                    "trainer.policy.model.fake_int4_qat.group_size": self.group_size,
                    "trainer.policy.model.fake_int4_qat.symmetric": True,
                    "trainer.policy.model.fake_int4_qat.scale_divisor": sd,
                    "trainer.policy.model.fake_int4_qat.q_min": qmin,
                    "trainer.policy.model.fake_int4_qat.bf16_base_path": self.bf16_base_path,
                }
            )
        if self.tis_ratio_type is not None:
            o["trainer.algorithm.off_policy_correction.tis_ratio_type"] = self.tis_ratio_type
            o["trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high"] = self.token_tis_ratio_clip_high
        return [f"{k}={_fmt(v)}" for k, v in o.items()]

    def env(self) -> dict[str, str]:
        """Environment for every node, exported **before** ``ray start`` (SkyRL forwards only some
        variables through the Ray runtime env): select our vLLM plugin in the engines."""
        return {
            "VLLM_PLUGINS": "kimi",
            "SKYRL_FROZEN_OFFLOAD_DIR": os.environ.get("SKYRL_FROZEN_OFFLOAD_DIR", "/data/skyrl/frozen-offload"),
        }
