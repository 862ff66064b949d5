"""The demo's Megatron trainer: LoRA on a Kimi model built by ``kimi_megatron_plugin``, one gloo process.

Glue, not plugin code: it drives the plugin's public pieces (``provider``, ``checkpoint``, ``lora``,
``routing_replay``) the way the demo and ``check-numerics`` need; ``kimi_rl_glue.demo.trainer.make_trainer``
imports :class:`MegatronLoraTrainer` when megatron-core is installed. The base is the
checkpoint itself: dense weights in fp32 (exact copies of the bf16 release tensors), routed
experts as the packed INT4/MXFP4 bytes (``KimiExperts`` ``w4a16`` mode, dequantized exactly in
fp32), so the trainer sees the served 4-bit grid bit for bit. Only the LoRA factors train (AdamW).

Example::

    t = MegatronLoraTrainer("/tmp/tiny-k2", LoraSpec(rank=8, exclude_modules=("kv_b_proj",)), lr=1e-3)
    loss = t.logits(ids).logsumexp(-1).mean(); t.step(loss)
    t.export_adapter().save("/tmp/adapter")
    t.close()
"""

from __future__ import annotations

import os
import socket

import torch

from kimi_core.lora import Adapter, LoraSpec

__all__ = ["MegatronLoraTrainer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MegatronLoraTrainer:
    """LoRA training on ``kimi_megatron_plugin`` (world size 1, CPU or one GPU).

    :param ckpt: HF checkpoint directory: packed 4-bit experts (``expert_mode="w4a16"``) or BF16 masters
        (``"qat"``: fake-quantized onto ``grid`` in the forward; ``"dense"``: as stored).
    :param spec: the :class:`LoraSpec` (targets, rank, expert layout).
    :param lr: AdamW learning rate (weight decay 0) over the LoRA parameters only.
    :param seed: LoRA initialisation seed.
    :param grid: ``(scale_divisor, q_min)`` of the INT4 grid QAT rounds onto (Kimi: ``(7.0, -7)``).
    :param quant_format: the served 4-bit format QAT rounds onto (BF16 masters have no ``quantization_config``).
    :param device: ``"cpu"`` (gloo, megatron's CPU shims) or ``"cuda"`` (NCCL, the current CUDA device).

    Initialises ``torch.distributed`` and megatron's parallel state when nothing did yet, and tears
    down in :meth:`close` exactly what it set up.
    """

    name = "megatron"

    def __init__(
        self,
        ckpt: str,
        spec: LoraSpec,
        lr: float,
        seed: int = 0,
        expert_mode: str = "w4a16",
        grid: tuple[float, int] | None = None,
        quant_format: str | None = None,
        device: str = "cpu",
    ):
        self.device = torch.device(device)
        if self.device.type == "cpu":
            from kimi_megatron_plugin import patches

            patches.apply_cpu_shims()
        from megatron.core import parallel_state as ps

        self._own_dist = not torch.distributed.is_initialized()
        self._own_mp = False
        if self._own_dist:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
            if self.device.type == "cuda":
                dev = torch.device("cuda", torch.cuda.current_device())
                torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
            else:
                torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        elif torch.distributed.get_world_size() != 1:
            raise RuntimeError(
                f"MegatronLoraTrainer runs in one process; torch.distributed has world size "
                f"{torch.distributed.get_world_size()}"
            )
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
            self._own_mp = True
            if self.device.type == "cuda":
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(seed)
        from kimi_megatron_plugin import checkpoint
        from kimi_megatron_plugin.lora import apply_lora
        from kimi_megatron_plugin.models import provider

        quant = {} if grid is None else {"scale_divisor": grid[0], "q_min": grid[1]}
        if quant_format is not None:
            quant["quant_format"] = quant_format
        self.model = provider.build_model_from_hf(
            ckpt,
            perform_initialization=False,
            params_dtype=torch.float32,
            moe_enable_routing_replay=True,
            expert_mode=expert_mode,
            **quant,
        )
        checkpoint.load_hf_checkpoint(self.model, ckpt)
        self.config = self.model.kimi_config
        self.spec = spec
        self.lora = apply_lora(self.model, spec, seed=seed)
        self.opt = torch.optim.AdamW(self.lora.parameters(), lr=lr, weight_decay=0.0)
        self.steps = 0

    def logits(self, ids: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, V]`` fp32 logits of ``ids [B, T]`` (int64, any device), on the trainer's device,
        differentiable w.r.t. the LoRA factors.

        :param routed_experts: int ``[B, T, num_hidden_layers, k]``: replay these experts (R3,
            :func:`kimi_megatron_plugin.routing_replay.replay_routing`) instead of routing.
        """
        from kimi_megatron_plugin.routing_replay import replay_routing

        ids = ids.to(self.device, torch.long)
        pos = torch.arange(ids.shape[1], device=self.device)[None].expand(ids.shape[0], -1)
        if routed_experts is not None:
            routed_experts = routed_experts.to(self.device)
        with replay_routing(self.model, routed_experts):
            return self.model(ids, pos, attention_mask=None).float()

    def step(self, loss: torch.Tensor, max_grad_norm: float = 1.0) -> float:
        """``backward``, clip to ``max_grad_norm``, one AdamW step; returns the pre-clip grad norm."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.lora.finalize_grads()
        gn = torch.nn.utils.clip_grad_norm_(list(self.lora.parameters()), max_grad_norm)
        self.opt.step()
        self.steps += 1
        return float(gn)

    #: file layout of :meth:`export_adapter` (``"shared_outer"`` for SGLang's ``--experts-shared-outer-loras``)
    export_layout = "per_expert"
    #: :meth:`export_adapter` copies the tensors to the CPU (the disk sync); ``False`` keeps them on the
    #: trainer's device (a tensor sync to a colocated engine sends CUDA-IPC handles instead)
    export_to_cpu = True

    def export_adapter(self) -> Adapter:
        """The adapter (bf16, PEFT names in :attr:`export_layout`, ``adapter_config`` from the spec), its tensors on
        the CPU unless :attr:`export_to_cpu` is off (what the disk sync writes and vLLM loads)."""
        ad = self.lora.export(self.export_layout, torch.bfloat16)
        if self.device.type != "cpu" and self.export_to_cpu:
            ad.tensors = {k: v.cpu() for k, v in ad.tensors.items()}
        return ad

    def save(self, directory: str) -> str:
        """Adapter + optimizer shard and the HF export (:func:`kimi_megatron_plugin.lora.checkpoint.save`)."""
        from kimi_megatron_plugin.lora import checkpoint as lck

        return lck.save(directory, self.lora, self.opt, step=self.steps)

    def load(self, directory: str) -> None:
        """Resume from :meth:`save` (factors, AdamW state and step count)."""
        from kimi_megatron_plugin.lora import checkpoint as lck

        self.steps = lck.load(directory, self.lora, self.opt)["step"]

    def close(self) -> None:
        """Remove the LoRA hooks and tear down what ``__init__`` initialised."""
        from megatron.core import parallel_state as ps

        self.lora.remove()
        if self._own_mp:
            ps.destroy_model_parallel()
            self._own_mp = False
        if self._own_dist and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._own_dist = False
