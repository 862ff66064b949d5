"""The ``lora_dir_prepare`` patch's decisions on a PEFT folder handed to vLLM directly, without an engine.

Scalings are checked against hand-computed numbers: tiny K2 has ``top_k = 4``; the adapters are rank 16,
alpha 32, capacity-normalised (routed experts at rank 16 // 4 = 4 through ``rank_pattern``), so PEFT scales
dense modules by 32 / 16 = 2 and experts by 32 / 4 = 8. vLLM 0.26 applies ``lora_alpha / r`` of the file to
every module; served right, the prepared folder has ``lora_alpha / r = 2`` and expert ``lora_B`` times 4.
"""

from __future__ import annotations

import inspect
import json
import os
from types import SimpleNamespace

import pytest
import torch
from vllm_adapters import spec

from kimi_core.errors import AdapterRejected
from kimi_core.lora import Adapter, LoraSpec, random_adapter

pytest.importorskip("vllm")

DENSE_SCALING, EXPERT_SCALING = 32 / 16, 32 / 4  # PEFT's alpha / r per module, by hand


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


@pytest.fixture(scope="module")
def cfg(k2):
    from kimi_core.config import load_config

    c = load_config(k2)
    assert c.num_experts_per_tok == 4  # the hand-computed scalings assume top_k 4
    return c


@pytest.fixture(scope="module")
def normalised(cfg, tmp_path_factory):
    """A capacity-normalised per-expert adapter folder (the raw PEFT form a trainer writes)."""
    d = tmp_path_factory.mktemp("raw") / "adapter"
    return random_adapter(cfg, spec("per_expert"), seed=1, b_std=0.3).save(d)


def prepare(path, cfg, out, max_rank=16):
    from kimi_vllm_plugin.patches.lora_dir_prepare import prepared_adapter_dir

    return prepared_adapter_dir(str(path), cfg, max_lora_rank=max_rank, out_dir=str(out), name="raw")


def global_scaling(folder) -> float:
    """What vLLM 0.26 applies to every module of ``folder``: its ``lora_alpha / r``."""
    c = json.load(open(os.path.join(folder, "adapter_config.json")))
    return c["lora_alpha"] / c["r"]


def test_capacity_normalised_folder_is_folded_to_the_hand_computed_scaling(normalised, cfg, tmp_path):
    raw = Adapter.load(normalised)
    assert raw.adapter_config["rank_pattern"], "the fixture must carry a rank_pattern"
    out = prepare(normalised, cfg, tmp_path / "out")
    assert out == str(tmp_path / "out")
    got = Adapter.load(out)
    c = got.adapter_config
    assert c["rank_pattern"] == {} and c["alpha_pattern"] == {}
    assert global_scaling(out) == DENSE_SCALING
    assert c["kimi_rl"]["folded_scaling"]["ratios"] == [EXPERT_SCALING / DENSE_SCALING]
    assert got.tensors.keys() == raw.tensors.keys()
    n_exp = 0
    for k, b in raw.tensors.items():
        want = b * (EXPERT_SCALING / DENSE_SCALING) if (".experts." in k and "lora_B" in k) else b
        assert torch.equal(got.tensors[k], want), k
        n_exp += ".experts." in k and "lora_B" in k
    assert n_exp > 0
    # served by 0.26's global rule, an expert gets 2 * (4 B) A = 8 B A: PEFT's alpha / r_e, by hand
    assert global_scaling(out) * EXPERT_SCALING / DENSE_SCALING == EXPERT_SCALING


def test_vllm_032_reading_of_the_raw_folder_equals_026_reading_of_the_prepared_one(normalised, cfg, tmp_path):
    """vLLM 0.32's own PEFTHelper (which reads the patterns) on the raw folder gives each module the scaling
    that 0.26's global rule, times the folded ratio, gives on the prepared folder."""
    from vllm.lora.peft_helper import PEFTHelper

    out = prepare(normalised, cfg, tmp_path / "out")
    helper = PEFTHelper.from_local_dir(normalised, None)
    raw, got = Adapter.load(normalised), Adapter.load(out)
    for k in raw.tensors:
        if not k.endswith(".lora_B.weight"):
            continue
        module = k[len("base_model.model.") : -len(".lora_B.weight")]
        r_m, s_m = helper.get_rank_and_scaling(module)
        assert s_m == (EXPERT_SCALING if ".experts." in k else DENSE_SCALING), (k, r_m, s_m)
        ratio = (got.tensors[k].double() / raw.tensors[k].double()).nan_to_num(nan=1.0)
        assert torch.all(global_scaling(out) * ratio[raw.tensors[k] != 0] == s_m), k


def test_prepared_folder_is_served_as_it_is_never_folded_twice(normalised, cfg, tmp_path):
    out = prepare(normalised, cfg, tmp_path / "once")
    assert prepare(out, cfg, tmp_path / "twice") is None
    assert not os.path.exists(tmp_path / "twice")


def test_recorded_fold_with_patterns_again_is_refused(normalised, cfg, tmp_path):
    out = prepare(normalised, cfg, tmp_path / "once")
    c = json.load(open(os.path.join(out, "adapter_config.json")))
    c["rank_pattern"] = {r"experts\.\d+\.gate_proj": 4}
    json.dump(c, open(os.path.join(out, "adapter_config.json"), "w"))
    with pytest.raises(AdapterRejected, match=r"once.*folded_scaling.*twice"):
        prepare(out, cfg, tmp_path / "again")


def test_folder_vllm_already_serves_right_is_loaded_unchanged(cfg, tmp_path):
    """No patterns, per-expert keys: validated, and vLLM reads the host's own folder (None)."""
    s = LoraSpec(rank=16, alpha=32.0, target_modules="all-linear", exclude_modules=("kv_b_proj",))
    d = random_adapter(cfg, s, seed=5).save(tmp_path / "plain")
    assert prepare(d, cfg, tmp_path / "out") is None


def test_pattern_free_lower_rank_experts_keep_vllms_global_scaling(normalised, cfg, tmp_path):
    """A SkyRL-style export (experts at rank 4, ``r / r'`` and ``alpha / r`` already in ``lora_B``,
    ``lora_alpha = r = 16``, no patterns) is accepted and served by vLLM's rule: 16 / 16 = 1 everywhere."""
    raw = Adapter.load(normalised)
    sky = raw.copy()
    for k, b in raw.tensors.items():
        if "lora_B" in k:
            sky.tensors[k] = b * (EXPERT_SCALING if ".experts." in k else DENSE_SCALING)
    sky.adapter_config.update(lora_alpha=16, rank_pattern={}, alpha_pattern={})
    d = sky.save(tmp_path / "sky")
    out = prepare(d, cfg, tmp_path / "out")
    got = Adapter.load(out if out is not None else d)
    assert global_scaling(out or d) == 1.0
    for k, b in sky.tensors.items():
        assert torch.equal(got.tensors[k], b), k


def test_shared_outer_layout_is_rewritten_per_expert(cfg, tmp_path):
    d = random_adapter(cfg, spec("shared_outer"), seed=2, b_std=0.3).save(tmp_path / "so")
    out = prepare(d, cfg, tmp_path / "out")
    assert out is not None
    names = list(Adapter.load(out).tensors)
    assert any(".experts.0.gate_proj.lora_A" in n for n in names) and global_scaling(out) == DENSE_SCALING


@pytest.mark.parametrize(
    "bad,match",
    [
        ("kv_b", r"'raw' from \S*/kv_b .*kv_b_proj\.lora_[AB]\.weight: vLLM serves no LoRA on kv_b_proj"),
        ("nan", r"'raw' from \S*/nan .*experts\.\d+\.\w+\.lora_B\.weight.*NaN"),
        ("rank32", r"'raw' from \S*/rank32 \(engine max_lora_rank 16\).*rank 32 > max_rank 16"),
    ],
)
def test_adapter_not_servable_right_is_refused_naming_folder_and_tensor(normalised, cfg, tmp_path, bad, match):
    a = Adapter.load(normalised)
    if bad == "kv_b":
        a = random_adapter(cfg, LoraSpec(rank=8, alpha=8.0, target_modules=("kv_b_proj",)), seed=4)
    elif bad == "nan":
        k = sorted(n for n in a.tensors if ".experts." in n and "lora_B" in n)[0]
        t = a.tensors[k].clone()
        t[0, 0] = float("nan")
        a.tensors[k] = t
    else:
        a = random_adapter(cfg, LoraSpec(rank=32, alpha=32.0, exclude_modules=("kv_b_proj",)), seed=3)
    d = a.save(tmp_path / bad)
    with pytest.raises(AdapterRejected, match=match):
        prepare(d, cfg, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_patterns_without_readable_tensors_are_refused(normalised, cfg, tmp_path):
    """A tensorizer adapter (vLLM 0.26) cannot be folded here: refused when its config has patterns."""
    from kimi_vllm_plugin.patches.lora_dir_prepare import prepared_adapter_dir

    with pytest.raises(AdapterRejected, match=r"rank_pattern / alpha_pattern.*safetensors"):
        prepared_adapter_dir(normalised, cfg, max_lora_rank=16, out_dir=str(tmp_path / "o"), tensors_readable=False)


def test_wrapped_load_hands_vllm_the_prepared_folder_for_kimi_models_only(normalised, k2, monkeypatch):
    """The installed wrapper: a Kimi model's request reaches vLLM's loader with the prepared folder (alive
    during the load, removed after); another model's request reaches it untouched."""
    import vllm.lora.worker_manager as wm
    from vllm.lora.request import LoRARequest

    from kimi_vllm_plugin.patches import lora_dir_prepare

    seen = []

    def upstream(self, lora_request):
        p = lora_request.lora_path
        seen.append((p, os.path.isdir(p), global_scaling(p) if os.path.isdir(p) else None))
        return "loaded"

    upstream.__signature__ = inspect.signature(wm.WorkerLoRAManager._load_adapter)
    monkeypatch.setattr(wm.WorkerLoRAManager, "_load_adapter", upstream)
    lora_dir_prepare.install()
    lora_dir_prepare.install()  # idempotent
    wrapped = wm.WorkerLoRAManager._load_adapter
    assert wrapped is not upstream and wrapped.__wrapped__ is upstream

    def manager(model):
        return SimpleNamespace(
            _adapter_manager=SimpleNamespace(model=model), lora_config=SimpleNamespace(max_lora_rank=16)
        )

    req = LoRARequest("raw", 7, normalised)
    kimi = SimpleNamespace(**{lora_dir_prepare.CHECKPOINT_ATTR: k2})
    assert wrapped(manager(kimi), req) == "loaded"
    staged, alive, scaling = seen[-1]
    assert staged != normalised and alive and scaling == DENSE_SCALING and not os.path.exists(staged)
    assert wrapped(manager(SimpleNamespace()), req) == "loaded"
    assert seen[-1] == (normalised, True, global_scaling(normalised))


def test_served_model_config_from_folder_or_hub_config(k2, cfg):
    """A local checkpoint is recorded as its folder; a hub id (no folder) as the HF config vLLM parsed; both
    give the model's KimiConfig, and an unreadable one refuses the adapter with the reason."""
    from kimi_vllm_plugin.patches.lora_dir_prepare import CHECKPOINT_ATTR, _kimi_config, mark_model

    hf = json.load(open(os.path.join(k2, "config.json")))
    for name in (k2, "moonshotai/not-a-local-folder"):
        vc = SimpleNamespace(model_config=SimpleNamespace(model=name, hf_config=SimpleNamespace(to_dict=lambda: hf)))
        m = SimpleNamespace()
        mark_model(m, vc)
        got = getattr(m, CHECKPOINT_ATTR)
        assert got == (k2 if name == k2 else hf)
        c = _kimi_config(got)
        assert (c.architecture, c.num_experts_per_tok, c.hidden_size) == (
            cfg.architecture,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
        )
    with pytest.raises(AdapterRejected, match="served Kimi model's config"):
        _kimi_config({"architectures": ["LlamaForCausalLM"]})
