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

import asyncio
import time

from kimi_core.errors import PluginError
from kimi_core.lora import ALL_LINEAR, LoraSpec
from kimi_core.lora.naming import hf_leaves

__all__ = ["build_policy_worker", "expert_mode_of", "lora_spec_of", "LOG_PREFIX"]

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
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.strip("[]").replace("'", "").replace('"', "").split(",") if v.strip()]
    return [str(v).strip() for v in value]


def lora_spec_of(lora_cfg, model_cfg, base_path: str, skyrl_normalize: bool | None = None) -> LoraSpec:
    """The :class:`~kimi_core.lora.LoraSpec` of SkyRL's ``trainer.policy.model.lora`` (+ our ``kimi`` options).

    ``target_modules`` / ``exclude_modules`` take Megatron leaves (``linear_proj``, ``linear_fc1``, ...) as SkyRL's
    Megatron path does, or HF leaves; ``all-linear`` is every Kimi LoRA target. Routed experts train at rank
    ``rank // top_k`` with ``kimi.normalize_moe_lora``; ``skyrl_normalize`` is SkyRL's own
    ``megatron_config.lora_config.normalize_moe_lora`` where the release has it (``None`` where not): they must agree.

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
        normalize_moe_lora=ours,
        base_model_name_or_path=base_path,
    )


def _say(rank: int, msg: str, *args) -> None:
    """One line on rank 0's stdout (SkyRL forwards worker output to the driver's log)."""
    if rank == 0:
        print(f"{LOG_PREFIX} {msg % args if args else msg}", flush=True)


def build_policy_worker():
    """The ``KimiMegatronPolicyWorker`` class (a subclass of SkyRL's ``MegatronPolicyWorkerBase``), not remote."""
    import torch

    from kimi_megatron_plugin.patches import te_stub

    te_stub.install()  # SkyRL's worker imports megatron-bridge, which needs this where TransformerEngine is absent
    from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorkerBase

    class KimiMegatronPolicyWorker(MegatronPolicyWorkerBase):
        """SkyRL's Megatron policy worker building the Kimi model (see :mod:`kimi_rl_glue.skyrl.worker`)."""

        def init_model(self, model_path, num_training_steps: int = 1e9):
            from kimi_megatron_plugin import bridge

            bridge.register(force=True)
            out = super().init_model(model_path, num_training_steps)
            params = [p for chunk in self.actor_module for p in chunk.parameters()]
            _say(
                self._rank,
                "model built: %d parameters (%d trainable), %s",
                sum(p.numel() for p in params),
                sum(p.numel() for p in params if p.requires_grad),
                sorted({str(p.dtype) for p in params}),
            )
            return out

        def init_configs(self, model_path, *args, **kwargs):
            from kimi_core.config import load_config
            from kimi_megatron_plugin.bridge.model_bridge import KimiBridge

            super().init_configs(model_path, *args, **kwargs)
            source = kwargs.get("bridge_weights_path") or model_path
            chosen = self.bridge._model_bridge
            if not isinstance(chosen, KimiBridge):
                raise PluginError(
                    f"{source}: Megatron-Bridge chose {type(chosen).__name__}, not a kimi_megatron_plugin bridge; "
                    "trainer.override_entrypoint=kimi_rl_glue.skyrl.main serves Kimi K2.x / K3 / K3.1 checkpoints only"
                )
            kimi = load_config(model_path)
            group = kimi.quant.group_size if kimi.quant is not None else None
            mode, kw = expert_mode_of(self.cfg.policy.model, group)
            if mode == "w4a16" and kimi.quant is None:
                raise PluginError(
                    f"{model_path}: trainer.policy.model.kimi.expert_weights=int4 needs a checkpoint with packed "
                    "INT4 / MXFP4 experts; this one has none (use expert_weights=bf16)"
                )
            self.provider.expert_mode, self.provider.expert_kwargs = mode, kw
            ep = self.provider.expert_model_parallel_size
            if self._is_lora and ep > 1:
                raise PluginError(
                    f"trainer.policy.megatron_config.expert_model_parallel_size={ep}: the Kimi LoRA's shared expert "
                    "factors need their EP reduction wired into SkyRL's DDP; use expert parallel size 1"
                )
            _say(self._rank, "bridge %s, experts %s%s", type(chosen).__name__, mode, f" {kw}" if kw else "")

        def make_megatron_module(
            self, wrap_with_ddp=True, ddp_config=None, lora_config=None, lora_type="lora", bf16=True
        ):
            from kimi_megatron_plugin.lora import attach_lora

            if lora_config is not None:
                if lora_type != "lora":
                    raise PluginError(
                        f"trainer.policy.megatron_config.lora_config.lora_type={lora_type!r}: Kimi LoRA is 'lora'"
                    )
                theirs = getattr(self.cfg.policy.megatron_config.lora_config, "normalize_moe_lora", None)
                spec = lora_spec_of(lora_config, self.cfg.policy.model, self.cfg.policy.model.path, theirs)
                seed = int(self.cfg.seed)
                rank = self._rank

                def kimi_lora_hook(chunks):
                    for chunk in chunks:
                        lora = attach_lora(chunk, spec, seed=seed)
                        n = sum(p.numel() for p in lora.parameters())
                        _say(
                            rank,
                            "LoRA rank %d (experts %d), %d dense modules, %d expert groups, %d parameters",
                            spec.rank,
                            spec.expert_rank(chunk.kimi_config.num_experts_per_tok),
                            len(lora.dense),
                            len(lora.experts),
                            n,
                        )
                    return chunks

                self.provider.register_pre_wrap_hook(kimi_lora_hook)
                self.kimi_lora_spec = spec
            return super().make_megatron_module(
                wrap_with_ddp=wrap_with_ddp, ddp_config=ddp_config, lora_config=None, lora_type=lora_type, bf16=bf16
            )

        async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg, model_id=None):
            merge = self.cfg.policy.megatron_config.lora_config.merge_lora
            if not self._is_lora or merge:
                return await super().broadcast_to_inference_engines(
                    inference_engine_client, inference_engine_cfg, model_id
                )
            if model_id is not None:
                raise PluginError(f"multi-adapter sync (model_id={model_id!r}) is not supported by the Kimi worker")
            t0 = time.perf_counter()
            reset = inference_engine_cfg.enable_prefix_caching and (
                not self.cfg.fully_async.enabled or self.cfg.fully_async.clear_kv_cache_on_weight_sync
            )
            leader = torch.distributed.get_rank() == 0
            reset_task = (
                inference_engine_client.reset_prefix_cache(reset_running_requests=True) if reset and leader else None
            )
            name, path = self._lora_target()
            adapter = self._export_adapter()  # collective over TP / EP / PP
            if leader:
                await asyncio.to_thread(adapter.save_replacing, path)
                await self._load_adapter(inference_engine_client, name, path)
            if reset_task is not None:
                await reset_task
            torch.distributed.barrier()
            _say(
                self._rank,
                "adapter synced: %d tensors -> %s as %r, prefix cache reset %s, sync_s %.3f",
                len(adapter.tensors),
                path,
                name,
                reset,
                time.perf_counter() - t0,
            )

        def _lora_target(self) -> tuple[str, str]:
            resolve = getattr(self, "_resolve_lora_sync_target", None)
            if resolve is not None:
                return resolve(None)
            from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import SKYRL_LORA_ADAPTER_NAME

            return SKYRL_LORA_ADAPTER_NAME, self.cfg.policy.model.lora.lora_sync_path

        def _export_adapter(self):
            from kimi_megatron_plugin.lora import export_adapter, lora_of

            loras = [lora_of(chunk) for chunk in self.actor_module]
            if any(lora is None for lora in loras):
                raise PluginError("the policy has no Kimi LoRA (trainer.policy.model.lora.rank must be > 0)")
            # per-expert layout with rank_pattern / alpha_pattern: the vLLM plugin prepares it inside vLLM
            return export_adapter(loras[0], layout="per_expert", dtype=torch.bfloat16)

        @staticmethod
        async def _load_adapter(client, name: str, path: str) -> None:
            from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

            if isinstance(client, RemoteInferenceClient):
                await client.load_lora_adapter(name, path)
                return
            from skyrl.backends.skyrl_train.weight_sync import LoraLoadRequest

            await client.update_named_weights(LoraLoadRequest(lora_path=path, lora_name=name))

    return KimiMegatronPolicyWorker
