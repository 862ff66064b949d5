"""The demo's trainer side: LoRA on a tiny Kimi model whose base is the served 4-bit grid exactly.

``Trainer`` is what the loop needs: ``logits(ids)`` with gradients into the adapter, an
optimizer step and ``export_adapter()`` of the adapter in PEFT form. Backends:

* ``megatron`` — :mod:`kimi_rl_glue.demo.megatron_trainer` on :mod:`kimi_megatron_plugin` (one gloo
  process, W4A16 experts computed from the checkpoint's packed bytes through ``kimi_core.kernels``),
  used when megatron-core and the plugin are installed.
* ``reference`` — ``kimi_core.reference`` with a :class:`~kimi_core.lora.trainable.TrainableAdapter`:
  the same exactly dequantized INT4 base in fp32; the fallback where Megatron is unavailable.
"""

from __future__ import annotations

import importlib

import torch

from kimi_core.lora import LoraSpec


class ReferenceTrainer:
    """LoRA RL on ``kimi_core.reference`` (fp32, exact INT4 base)."""

    name = "reference"

    def __init__(self, ckpt: str, spec: LoraSpec, lr: float, seed: int = 0):
        from kimi_core.lora.trainable import TrainableAdapter
        from kimi_core.reference import load_reference_model

        self.model = load_reference_model(ckpt)
        self.config = self.model.config
        self.adapter = TrainableAdapter(self.config, spec, seed=seed)
        self.opt = torch.optim.AdamW(self.adapter.parameters(), lr=lr, weight_decay=0.0)

    def logits(self, ids: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, V]`` fp32 logits of ``ids [B, T]``, differentiable w.r.t. the adapter;
        ``routed_experts`` (int ``[B, T, num_hidden_layers, k]``) are replayed (R3)."""
        return self.model(ids, adapter=self.adapter, routed_experts=routed_experts).float()

    def step(self, loss: torch.Tensor, max_grad_norm: float = 1.0) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), max_grad_norm)
        self.opt.step()
        return float(gn)

    def export_adapter(self):
        """The current adapter as a :class:`kimi_core.lora.Adapter` (bf16, per-expert PEFT names)."""
        return self.adapter.export()


def make_trainer(
    kind: str,
    ckpt: str,
    spec: LoraSpec,
    lr: float,
    seed: int = 0,
    expert_mode: str = "w4a16",
    grid: tuple[float, int] | None = None,
    quant_format: str | None = None,
    device: str = "cpu",
):
    """``kind`` in ``auto`` (megatron if available, else reference), ``megatron``, ``reference``.

    ``expert_mode`` / ``grid`` / ``quant_format``: the Megatron trainer's routed experts (``"w4a16"`` from the
    checkpoint's packed bytes, ``"qat"`` fake-INT4 of BF16 masters onto ``grid`` in ``quant_format``); the reference trainer serves only
    ``"w4a16"`` on the CPU (an exact dequantized base), so anything else needs Megatron."""
    reference_can = expert_mode == "w4a16" and device == "cpu"
    if kind in ("auto", "megatron"):
        try:
            mod = importlib.import_module("kimi_rl_glue.demo.megatron_trainer")
            return mod.MegatronLoraTrainer(
                ckpt,
                spec,
                lr=lr,
                seed=seed,
                expert_mode=expert_mode,
                grid=grid,
                quant_format=quant_format,
                device=device,
            )
        except ImportError as e:
            if kind == "megatron" or not reference_can:
                raise RuntimeError(
                    f"the Megatron trainer (kimi_rl_glue.demo.megatron_trainer) is unavailable ({e}); "
                    f"expert mode {expert_mode!r} on {device} needs it (pip install megatron-core)"
                ) from e
    if not reference_can:
        raise RuntimeError(
            f"--trainer reference trains only the served 4-bit base on the CPU, not expert mode "
            f"{expert_mode!r} on {device}; use --trainer megatron"
        )
    return ReferenceTrainer(ckpt, spec, lr, seed)
