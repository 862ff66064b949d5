"""SkyRL's Megatron policy worker with the Kimi model, the Kimi LoRA and the Kimi adapter sync.

SkyRL builds its policy in ``MegatronPolicyWorkerBase`` (``NovaSky-AI/SkyRL:skyrl/backends/skyrl_train/workers/
megatron/megatron_worker.py``) with Megatron-Bridge: ``AutoBridge.from_hf_pretrained(model.path)``, the bridge's
provider, Bridge PEFT LoRA as a pre-wrap hook, and ``bridge.export_adapter_weights`` for the LoRA sync. The
subclass :func:`build_policy_worker` returns changes four steps and nothing else:

=============================  ====================================================================================
step                           what the Kimi worker does
=============================  ====================================================================================
``init_model``                 registers this plugin's bridges in the worker process (:func:`kimi_megatron_plugin.
                               bridge.register`, forced: SkyRL's own bridges are registered when its worker module
                               is imported) before SkyRL's ``init_model`` runs
``init_configs``               SkyRL's, then checks that the bridge is ours and sets the expert mode
                               (:func:`expert_mode_of`) on the provider
``make_megatron_module``       Kimi LoRA (:func:`kimi_megatron_plugin.lora.attach_lora`: routed experts included,
                               which Bridge PEFT would skip) as the pre-wrap hook instead of Bridge PEFT
``broadcast_to_inference_      the adapter exported by :func:`kimi_megatron_plugin.lora.export_adapter` (per-expert
engines`` (LoRA, unmerged)     layout, ``rank_pattern`` / ``alpha_pattern`` kept), written atomically at
                               ``lora.lora_sync_path`` and loaded under SkyRL's adapter name, the prefix cache reset
                               as SkyRL resets it; the vLLM plugin prepares the folder inside vLLM
=============================  ====================================================================================

Everything else (the forward / backward, losses, optimizer, scheduler, packing, the generator) is SkyRL's.
:mod:`kimi_rl_glue.skyrl.main` puts the worker in place of SkyRL's ``PolicyWorker``. SkyRL is imported lazily
(it needs Python >= 3.12); the worker class is built on first use.
"""

from __future__ import annotations

import ast

from kimi_core.errors import PluginError
from kimi_core.lora import ALL_LINEAR, LoraSpec
from kimi_core.lora.naming import hf_leaves, target_names

__all__ = ["build_policy_worker", "expert_mode_of", "lora_spec_of", "say", "LOG_PREFIX"]

#: every line the worker logs starts with this (the GPU run's assertions look for it)
LOG_PREFIX = "[kimi-skyrl-worker]"

#: ``trainer.policy.model.kimi.expert_weights`` -> ``kimi_megatron_plugin`` expert mode without fake-quant
_MODE_OF = {"int4": "w4a16", "bf16": "dense"}


def expert_mode_of(model_cfg, checkpoint_group_size: int | None = None) -> tuple[str, dict]:
    """``(expert_mode, expert_kwargs)`` of the Kimi provider for SkyRL's ``trainer.policy.model``.

    ``kimi.expert_weights=int4``: ``w4a16`` (the release's packed experts, no masters). ``bf16``: BF16 masters,
    fake-quantized on the forward (``qat``, with ``fake_int4_qat``'s ``scale_divisor`` / ``q_min``) when
    ``fake_int4_qat.enabled``, else plain ``dense``.

    :raises PluginError: ``fake_int4_qat.group_size`` differs from the checkpoint's quantization group.
    """
    weights = model_cfg.kimi.expert_weights
    fq = getattr(model_cfg, "fake_int4_qat", None)
    if weights == "bf16" and fq is not None and fq.enabled:
        if checkpoint_group_size and int(fq.group_size) != int(checkpoint_group_size):
            raise PluginError(
                f"trainer.policy.model.fake_int4_qat.group_size={fq.group_size}, but the checkpoint's experts are "
                f"quantized in groups of {checkpoint_group_size}: the fake-quant must use the served grid"
            )
        return "qat", {"scale_divisor": float(fq.scale_divisor), "q_min": float(fq.q_min)}
    return _MODE_OF[weights], {}


def _names(value) -> list[str]:
    """SkyRL's target flag as names: a list, a comma-separated string, or the string form of a list literal
    (``"['linear_proj', 'linear_fc1']"``, as its dotlist parser can hand it over)."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = ast.literal_eval(value.strip())
    return target_names(value)


def lora_spec_of(
    lora_cfg, model_cfg, base_path: str, skyrl_normalize: bool | None = None, shared_outer: bool = False
) -> LoraSpec:
    """The :class:`~kimi_core.lora.LoraSpec` of SkyRL's ``trainer.policy.model.lora`` (+ our ``kimi`` options).

    ``target_modules`` / ``exclude_modules`` take Megatron leaves (``linear_proj``, ``linear_fc1``, ...) as SkyRL's
    Megatron path does, or HF leaves; ``all-linear`` is every Kimi LoRA target. Routed experts train at rank
    ``rank // top_k`` with ``kimi.normalize_moe_lora``; ``skyrl_normalize`` is SkyRL's own
    ``megatron_config.lora_config.normalize_moe_lora`` where the release has it (``None`` where not): they must agree.
    ``shared_outer``: SkyRL's ``megatron_config.lora_config.experts_shared_outer_loras`` (skyrl 0.4.0): routed experts
    share gate/up's A and down's B per layer (``expert_layout="shared_outer"``); the adapter is still served per expert.

    :raises PluginError: dropout (Kimi LoRA has none), a non-``kaiming`` / ``normal`` init, or disagreeing flags.
    """
    if float(getattr(lora_cfg, "dropout", 0.0) or 0.0) != 0.0:
        raise PluginError(f"trainer.policy.model.lora.dropout={lora_cfg.dropout}: Kimi LoRA has no dropout; set 0")
    ours = bool(model_cfg.kimi.normalize_moe_lora)
    if skyrl_normalize is not None and bool(skyrl_normalize) != ours:
        raise PluginError(
            f"trainer.policy.megatron_config.lora_config.normalize_moe_lora={skyrl_normalize} but "
            f"trainer.policy.model.kimi.normalize_moe_lora={ours}: set both the same"
        )
    targets = _names(lora_cfg.target_modules)
    if not targets:
        raise PluginError("trainer.policy.model.lora.target_modules is empty")
    return LoraSpec(
        rank=int(lora_cfg.rank),
        alpha=float(lora_cfg.alpha),
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else hf_leaves(targets),
        exclude_modules=hf_leaves(_names(getattr(lora_cfg, "exclude_modules", None))),
        expert_layout="shared_outer" if shared_outer else "per_expert",
        normalize_moe_lora=ours,
        base_model_name_or_path=base_path,
    )


def say(rank: int, msg: str, *args) -> None:
    """One line on rank 0's stdout (SkyRL forwards worker output to the driver's log)."""
    if rank == 0:
        print(f"{LOG_PREFIX} {msg % args if args else msg}", flush=True)


def build_policy_worker():
    """The ``KimiMegatronPolicyWorker`` class (a subclass of SkyRL's ``MegatronPolicyWorkerBase``), not remote."""
    from kimi_rl_glue.skyrl.policy_worker import KimiMegatronPolicyWorker

    return KimiMegatronPolicyWorker
