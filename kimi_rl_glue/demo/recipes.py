"""The demo's recipes: which checkpoint the engine serves, what the trainer trains on, and the loss.

* ``cpu-k2`` (``make demo``): the trainer computes the served INT4 experts exactly from their packed bytes
  (``kimi_megatron_plugin`` W4A16 mode), score-centering loss, LoRA rank ``r`` everywhere.
* ``skyrl-k2`` (seed 003, SkyRL's K2.x recipe in miniature, :mod:`kimi_rl_glue.skyrl.recipe`): the trainer
  loads BF16 masters written by ``kimi-rl dequantize`` (verified fixed points of the served grid) and
  fake-quantizes the frozen expert weights back onto the same INT4 grid in every forward (QAT mode,
  straight-through); routed-expert adapters get rank ``r // top_k`` (capacity-normalised, PEFT
  ``rank_pattern``); GRPO with DAPO's clip-higher (0.2 / 0.28) and dynamic sampling (groups with equal rewards
  masked out) and token-level TIS; the adapter is hot-loaded from disk under a fresh name.
* ``miles-k3`` (seeds 000 / 001, miles' K3 recipe in miniature, ``--device cuda`` only): SGLang serves the MXFP4
  K3 checkpoint through ``kimi_sglang_plugin``; the trainer computes the served MXFP4 experts from their packed
  bytes (W4A16 mode, no BF16 copy; with the demo trainer's fp32 activations each expert is dequantized exactly
  as it is used, not by the bf16 fused grouped GEMM), LoRA rank 32 alpha 64 on every linear SGLang gives LoRA, experts shared-outer;
  score-centering loss; the engine's routed experts are replayed in the trainer (R3); each version goes to the
  live engine as tensors (CUDA-IPC handles, sha256 per tensor checked by SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoRecipe", "RECIPES", "KIMI_INT4_GRID"]

#: the Kimi QAT convention of the served INT4 grid: (scale divisor, q_min): scale = amax / 7, q in [-7, 7]
KIMI_INT4_GRID = (7.0, -7)


@dataclass(frozen=True)
class DemoRecipe:
    """One recipe of ``kimi-rl demo --recipe NAME``.

    :param trainer_base: ``"served"`` (the 4-bit checkpoint the engine serves) or ``"bf16_masters"``
        (``kimi-rl dequantize`` of it, verified).
    :param expert_mode: ``kimi_megatron_plugin.models.experts`` mode of the trainer's routed experts
        (``"w4a16"`` from packed bytes, ``"qat"`` fake-INT4 from BF16 masters).
    :param normalize_moe_lora: routed experts get LoRA rank ``rank // top_k``.
    :param trainer: ``make_trainer`` kind (``"auto"`` falls back to ``kimi_core.reference``; QAT needs Megatron).
    :param dynamic_sampling: DAPO's group filter on the GRPO loss (:class:`~.loop.LoopConfig`).
    :param model: the ``make-tiny`` family served (``"k2"``: INT4 experts, ``"k3"``: MXFP4 experts).
    :param engine: ``"vllm"`` (adapters hot-loaded from disk) or ``"sglang"`` (GPU only; adapters as tensors
        over CUDA IPC into the live engine, its routed experts replayed in the trainer, R3).
    :param expert_layout: the LoRA expert layout trained and served (``"shared_outer"``: SGLang's
        ``--experts-shared-outer-loras``).
    """

    name: str
    summary: str
    trainer_base: str
    expert_mode: str
    normalize_moe_lora: bool
    loss: str
    rank: int
    trainer: str
    dynamic_sampling: bool = False
    model: str = "k2"
    engine: str = "vllm"
    expert_layout: str = "per_expert"


RECIPES = {
    "cpu-k2": DemoRecipe(
        "cpu-k2",
        "LoRA RL on the served INT4 experts (W4A16 trainer), score centering",
        trainer_base="served",
        expert_mode="w4a16",
        normalize_moe_lora=False,
        loss="score_centering",
        rank=8,
        trainer="auto",
    ),
    "skyrl-k2": DemoRecipe(
        "skyrl-k2",
        "SkyRL K2.x: BF16 masters + fake-INT4 QAT experts, capacity-normalised "
        "expert LoRA, GRPO/DAPO + token TIS, adapter hot-loaded from disk",
        trainer_base="bf16_masters",
        expert_mode="qat",
        normalize_moe_lora=True,
        loss="grpo_tis",
        rank=16,
        trainer="megatron",
        dynamic_sampling=True,
    ),
    "miles-k3": DemoRecipe(
        "miles-k3",
        "miles K3: SGLang rollouts on the MXFP4 checkpoint, W4A16 trainer (no BF16 "
        "copy of the experts), shared-outer expert LoRA, score centering, R3 routing replay, "
        "adapter over CUDA IPC into the live engine",
        trainer_base="served",
        expert_mode="w4a16",
        normalize_moe_lora=False,
        loss="score_centering",
        rank=32,
        trainer="megatron",
        model="k3",
        engine="sglang",
        expert_layout="shared_outer",
    ),
}
