"""``KimiMegatronPolicyWorker`` driven through SkyRL 0.4.0's own Megatron worker code on the CPU.

SkyRL's ``MegatronPolicyWorkerBase.init_configs`` (its tokenizer, HF config, ``AutoBridge`` and provider set-up) and
``make_megatron_module`` (its DDP config and Bridge's ``provide_distributed_model``) run with our overrides, called
with the arguments SkyRL's ``init_model`` passes (skyrl 0.4.0 adds ``experts_shared_outer_loras``). Ray and CUDA are
left out: the worker object is made without its actor constructor and the model is built on the CPU.

Oracles: ``kimi_core.reference`` fp32 logits of the same checkpoint (the LoRA B factors start at zero, so the model
with LoRA equals the base), Bridge's own loader filling the model, and the adapter export's tensor count from the
checkpoint's shapes.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from py312_lane import require

skyrl_config = require("skyrl.train.config", "skyrl==0.4.0")
require("megatron.bridge", "megatron-bridge==0.6.2")
from utils import assert_close


def _async_checkpoint_stand_in() -> None:
    """skyrl 0.4.0's Megatron strategy imports ``AsyncCallsQueue`` from nvidia-resiliency-ext at module level (used
    only when it saves a checkpoint). PyPI's newest nvidia-resiliency-ext (0.4.1) fails megatron-core 0.19.2's own
    minimum-version assert (0.6.0) when both are installed, so this lane has none: megatron-core is imported first
    (it then records "no nvrx"), and the one name SkyRL imports is a stand-in that refuses use. No test here saves."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
        return
    except ImportError:
        pass
    import megatron.core.dist_checkpointing  # noqa: F401 - records the absence of nvrx before the stand-in exists

    class AsyncCallsQueue:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("nvidia-resiliency-ext is not installed in the py312 lane (checkpoint saving)")

    names = ["nvidia_resiliency_ext", "checkpointing", "async_ckpt", "core"]
    for i in range(len(names)):
        module = types.ModuleType(".".join(names[: i + 1]))
        module.__path__ = []  # a package, so the next name imports below it
        sys.modules[module.__name__] = module
    sys.modules["nvidia_resiliency_ext.checkpointing.async_ckpt.core"].AsyncCallsQueue = AsyncCallsQueue


_async_checkpoint_stand_in()
from kimi_rl_glue.skyrl.config import build_config

try:
    from kimi_rl_glue.skyrl.policy_worker import KimiMegatronPolicyWorker
except ImportError as e:  # skyrl 0.4.0's worker needs a Megatron-Bridge newer than PyPI's 0.6.2
    pytest.skip(
        f"SkyRL's Megatron worker does not import here ({e}); skyrl 0.4.0 pins a git Megatron-Bridge newer than "
        "PyPI's. Run against the staged SkyRL main site instead (tools/gpu/README-skyrl.md, 'CPU rehearsal')",
        allow_module_level=True,
    )

B, T = 2, 11


def _worker(path: str, expert_weights: str, shared_outer: bool = False):
    overrides = [
        "trainer.strategy=megatron",
        f"trainer.policy.model.path={path}",
        f"trainer.policy.model.kimi.expert_weights={expert_weights}",
        "trainer.policy.model.kimi.normalize_moe_lora=true",
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=16",
        "trainer.policy.model.lora.target_modules=['linear_proj','linear_fc1','linear_fc2']",
        "trainer.policy.megatron_config.lora_config.merge_lora=false",
        "trainer.logger=console",
    ]
    if shared_outer:  # a skyrl 0.4.0 field (SkyRL main has none)
        overrides.append("trainer.policy.megatron_config.lora_config.experts_shared_outer_loras=true")
    cfg = build_config(skyrl_config).from_cli_overrides(overrides)
    worker = KimiMegatronPolicyWorker.__new__(KimiMegatronPolicyWorker)  # no Ray actor constructor
    worker.cfg, worker._rank = cfg.trainer, 0
    worker.strategy = types.SimpleNamespace()  # init_model makes SkyRL's MegatronStrategy; init_configs stores on it
    return worker


def _build(worker, path: str, shared_outer: bool = False):
    mc = worker.cfg.policy.megatron_config
    worker.init_configs(path, mc, mc.model_config_kwargs, mc.transformer_config_kwargs, bf16=False, flash_attn=False)
    worker.provider.use_cpu_initialization = True
    chunks = worker.make_megatron_module(
        wrap_with_ddp=False,
        ddp_config=None,
        lora_config=worker.cfg.policy.model.lora,
        lora_type=mc.lora_config.lora_type,
        experts_shared_outer_loras=shared_outer,
        bf16=False,
    )
    worker.actor_module = chunks
    return chunks


@pytest.mark.parametrize("expert_weights,quant", [("int4", "int4"), ("bf16", None)])
def test_skyrl_builds_our_model_with_kimi_lora(expert_weights, quant, tiny_ckpt, mcore_world, capsys):
    """SkyRL's build path gives our Kimi K2 model (W4A16 on the packed INT4 experts, or BF16 experts), Kimi LoRA on
    attention, shared and routed experts (only the LoRA factors trainable), and kimi_core.reference's fp32 logits."""
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin.lora import lora_of

    path = tiny_ckpt("k2", quant=quant, layers=2)
    worker = _worker(path, expert_weights)
    (model,) = _build(worker, path)
    said = capsys.readouterr().out
    mode = "w4a16" if expert_weights == "int4" else "dense"
    assert f"[kimi-skyrl-worker] bridge {type(worker.bridge._model_bridge).__name__}, experts {mode}" in said
    assert worker.provider.expert_mode == mode
    lora = lora_of(model)
    assert lora is not None and len(lora.experts) > 0 and len(lora.dense) > 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("kimi_lora_params" in n for n in trainable)
    ids = torch.randint(0, model.kimi_config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None].expand(B, -1)
    with torch.no_grad():
        got = model(ids, pos, attention_mask=None)
    assert_close(f"k2 {expert_weights} via SkyRL's build", load_reference_model(path)(ids), got, 1e-4)
    adapter = worker._export_adapter()  # what broadcast_to_inference_engines writes for vLLM
    k = model.kimi_config
    expert_keys = [n for n in adapter.tensors if ".experts." in n and ".shared_experts." not in n]
    assert len(expert_keys) == (k.num_hidden_layers - k.first_k_dense_replace) * k.n_routed_experts * 3 * 2


def test_shared_outer_flag_of_skyrl_040_reaches_the_spec_and_exports_per_expert(tiny_ckpt, mcore_world):
    """skyrl 0.4.0's ``experts_shared_outer_loras=true`` trains the shared-outer layout (one gate/up A and one down B
    per layer); the sync still exports the per-expert layout vLLM serves, one A and B per expert and projection."""
    fields = {
        f.name for f in dataclasses.fields(skyrl_config.SkyRLTrainConfig().trainer.policy.megatron_config.lora_config)
    }
    if "experts_shared_outer_loras" not in fields:
        pytest.skip("this SkyRL has no megatron_config.lora_config.experts_shared_outer_loras (a skyrl 0.4.0 field)")
    path = tiny_ckpt("k2", quant="int4", layers=2)
    worker = _worker(path, "int4", shared_outer=True)
    _build(worker, path, shared_outer=True)
    assert worker.kimi_lora_spec.expert_layout == "shared_outer"
    adapter = worker._export_adapter()
    k = worker.actor_module[0].kimi_config
    moe_layers = k.num_hidden_layers - k.first_k_dense_replace
    expert_keys = [n for n in adapter.tensors if ".experts." in n and ".shared_experts." not in n]
    assert len(expert_keys) == moe_layers * k.n_routed_experts * 3 * 2  # gate, up, down x (A, B)
