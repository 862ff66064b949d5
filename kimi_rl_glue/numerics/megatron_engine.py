"""The ``megatron`` engine of ``kimi-rl check-numerics``: the trainer's model, with per-layer hidden states.

Builds ``kimi_megatron_plugin``'s model from the HF checkpoint through the demo trainer
(:class:`kimi_rl_glue.demo.megatron_trainer.MegatronLoraTrainer`: one gloo process, routed experts
as the packed 4-bit bytes), optionally loads a PEFT adapter into its LoRA
modules, and records the residual stream after the embedding and after every decoder layer
(``[S, B, H]`` transposed to ``[B, T, H]``; for K3 the attention-residual ``prefix``, unpacked
from the bank the layers carry), matching :meth:`kimi_core.reference.KimiReferenceModel.forward`'s
``hidden`` so the report can name the first diverging layer.
"""

from __future__ import annotations

import torch

from kimi_core.lora import LoraSpec
from kimi_rl_glue.numerics.engines import Engine, EngineResult


class MegatronNumericsEngine(Engine):
    """The Megatron model of :mod:`kimi_megatron_plugin`, scored in this process (fp32 by default)."""

    name = "megatron"
    install_hint = 'pip install "kimi-rl-plugins[megatron]"'

    def run(self, model_dir, input_ids, adapter=None, dtype=torch.float32):
        from kimi_megatron_plugin.models.pipeline import unpack_bank
        from kimi_rl_glue.demo.megatron_trainer import MegatronLoraTrainer

        # the LoRA modules are shaped by the adapter's own config; without one they are removed
        spec = LoraSpec(rank=8, alpha=16, exclude_modules=("kv_b_proj",))
        if adapter is not None:
            from kimi_core.lora import read_adapter_config

            spec = LoraSpec.from_adapter_config(read_adapter_config(adapter), f"{adapter}/adapter_config.json")
        t = MegatronLoraTrainer(model_dir, spec, lr=0.0)
        try:
            if adapter is not None:
                t.lora.load_adapter(adapter)
            else:
                t.lora.remove()
            H = t.config.hidden_size
            hidden: list[torch.Tensor] = []

            def grab(_m, _a, out):
                x = out[0] if isinstance(out, tuple) else out
                if x.shape[-1] > H:  # K3: [prefix | bank...] packed along the hidden dim
                    x = unpack_bank(x, H)[0]
                hidden.append(x.detach().transpose(0, 1).float())

            hooks = [t.model.embedding.register_forward_hook(grab)]
            hooks += [layer.register_forward_hook(grab) for layer in t.model.decoder.layers]
            with torch.no_grad():
                logits = t.logits(input_ids)
            for h in hooks:
                h.remove()
            lp = torch.log_softmax(logits[:, :-1].float(), -1)
            return EngineResult(lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), lp.argmax(-1), hidden)
        finally:
            t.close()


def numerics_engine() -> MegatronNumericsEngine:
    return MegatronNumericsEngine()
