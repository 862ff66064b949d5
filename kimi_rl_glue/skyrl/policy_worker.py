"""``KimiMegatronPolicyWorker``: SkyRL's Megatron policy worker with the Kimi model (see :mod:`kimi_rl_glue.skyrl.worker`).

A module-level class, so Ray pickles it by reference and every actor process imports this module first: it installs
``kimi_megatron_plugin``'s ``te_stub`` (a no-op where TransformerEngine loads) before SkyRL's worker module imports
megatron-bridge. Needs SkyRL (Python >= 3.12) and Megatron; :func:`kimi_rl_glue.skyrl.worker.build_policy_worker`
imports it on demand.
"""

from __future__ import annotations

import asyncio
import time
from inspect import signature

import torch

from kimi_core.errors import PluginError
from kimi_megatron_plugin.patches import te_stub
from kimi_rl_glue.skyrl.worker import expert_mode_of, lora_spec_of, say

te_stub.install()

from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import (  # noqa: E402 - after te_stub.install()
    MegatronPolicyWorkerBase,
)

__all__ = ["KimiMegatronPolicyWorker"]


class KimiMegatronPolicyWorker(MegatronPolicyWorkerBase):
    """SkyRL's Megatron policy worker building the Kimi model (see :mod:`kimi_rl_glue.skyrl.worker`)."""

    def init_model(self, model_path, num_training_steps: int = 1e9):
        out = super().init_model(model_path, num_training_steps)
        params = [p for chunk in self.actor_module for p in chunk.parameters()]
        say(
            self._rank,
            "model built: %d parameters (%d trainable), %s",
            sum(p.numel() for p in params),
            sum(p.numel() for p in params if p.requires_grad),
            sorted({str(p.dtype) for p in params}),
        )
        return out

    def init_configs(self, model_path, *args, **kwargs):
        from kimi_core.config import load_config
        from kimi_megatron_plugin import bridge
        from kimi_megatron_plugin.bridge.model_bridge import KimiBridge

        bridge.register(force=True)  # after SkyRL's own registrations, before its AutoBridge lookup
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
        say(self._rank, "bridge %s, experts %s%s", type(chosen).__name__, mode, f" {kw}" if kw else "")

    def make_megatron_module(
        self,
        wrap_with_ddp=True,
        ddp_config=None,
        lora_config=None,
        lora_type="lora",
        experts_shared_outer_loras=None,
        bf16=True,
    ):
        """SkyRL's model build with Kimi LoRA attached as the pre-wrap hook instead of Bridge PEFT.

        ``experts_shared_outer_loras``: skyrl 0.4.0 passes it (SkyRL main has no such argument, ``None`` here)."""
        from kimi_megatron_plugin.lora.attach import attach_lora, needs_ep_reduction

        if lora_config is not None:
            if lora_type != "lora":
                raise PluginError(
                    f"trainer.policy.megatron_config.lora_config.lora_type={lora_type!r}: Kimi LoRA is 'lora'"
                )
            theirs = getattr(self.cfg.policy.megatron_config.lora_config, "normalize_moe_lora", None)
            spec = lora_spec_of(
                lora_config, self.cfg.policy.model, self.cfg.policy.model.path, theirs, bool(experts_shared_outer_loras)
            )
            seed = int(self.cfg.seed)
            rank = self._rank

            def kimi_lora_hook(chunks):
                for chunk in chunks:
                    lora = attach_lora(chunk, spec, seed=seed)
                    if needs_ep_reduction(lora):
                        raise PluginError(
                            "shared-outer expert LoRA under expert parallelism needs its EP gradient sum, which "
                            "SkyRL's DDP does not do; use the per-expert layout"
                        )
                    n = sum(p.numel() for p in lora.parameters())
                    say(
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
        base = super().make_megatron_module
        release_kw = (
            {"experts_shared_outer_loras": False} if "experts_shared_outer_loras" in signature(base).parameters else {}
        )
        return base(
            wrap_with_ddp=wrap_with_ddp,
            ddp_config=ddp_config,
            lora_config=None,
            lora_type=lora_type,
            bf16=bf16,
            **release_kw,
        )

    async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg, model_id=None):
        merge = self.cfg.policy.megatron_config.lora_config.merge_lora
        if not self._is_lora or merge:
            return await super().broadcast_to_inference_engines(inference_engine_client, inference_engine_cfg, model_id)
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
        say(
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
        if len(loras) > 1:  # the export gathers pipeline stages, not virtual-pipeline chunks of one stage
            raise PluginError(
                f"{len(loras)} model chunks on this rank: the Kimi adapter sync exports one chunk per pipeline "
                "stage and does not support virtual pipeline parallelism"
            )
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
