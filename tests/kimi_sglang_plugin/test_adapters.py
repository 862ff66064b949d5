"""kimi_sglang_plugin.adapters: the adapter as SGLang serves it (one lora_alpha / r, its target names).

Oracles: ``kimi_core.reference`` with the original adapter (PEFT semantics: rank_pattern / alpha_pattern,
rsLoRA) against the prepared one read with one global scaling, and SGLang's own
``get_normalized_target_modules`` / the pool's subset rule for the target names.
"""

from __future__ import annotations

import pytest
import torch

from kimi_core.errors import AdapterRejected
from kimi_core.lora import Adapter, LoraSpec, random_adapter
from kimi_core.reference import load_reference_model
from kimi_sglang_plugin.adapters import prepare_adapter
from kimi_sglang_plugin.mapping import lora_target_modules

IDS = torch.tensor([[5, 17, 99, 3, 250, 511, 42, 7]])
K3_LEAVES = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w3",
    "w2",
)


def _global_scaling_only(ad: Adapter) -> Adapter:
    """What SGLang reads of an adapter config: lora_alpha and r, nothing else."""
    out = ad.copy()
    cfg = out.adapter_config
    out.adapter_config = {**cfg, "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False}
    return out


@pytest.fixture(scope="module")
def k3(tiny_ckpt):
    from kimi_core.config import load_config

    path = tiny_ckpt("k3")
    return path, load_config(path), load_reference_model(path, dtype=torch.float64)


@pytest.mark.parametrize(
    "layout,normalize,rslora",
    [("shared_outer", False, False), ("per_expert", True, False), ("per_expert", False, True)],
)
def test_prepared_adapter_is_served_alike_by_global_scaling(k3, layout, normalize, rslora):
    """Capacity-normalised experts (rank_pattern), rsLoRA and plain adapters: the prepared adapter read with
    SGLang's one ``lora_alpha / r`` (no patterns, no rsLoRA, one rank) gives the logprobs of the original
    read with PEFT's per-module scaling (float64 reference)."""
    _, cfg, ref = k3
    spec = LoraSpec(
        rank=16,
        alpha=32.0,
        target_modules=K3_LEAVES,
        expert_layout=layout,
        normalize_moe_lora=normalize,
        use_rslora=rslora,
    )
    ad = random_adapter(cfg, spec, seed=3, b_std=0.5)
    prepared = prepare_adapter(ad, cfg)
    want = ref.logprobs(IDS[:, :-1], IDS[:, 1:], adapter=ad)
    got = ref.logprobs(IDS[:, :-1], IDS[:, 1:], adapter=_global_scaling_only(prepared))
    base = ref.logprobs(IDS[:, :-1], IDS[:, 1:])
    assert (want - base).abs().max() > 0.05, "the adapter must move logprobs for the check to mean anything"
    assert torch.allclose(got, want, atol=1e-9, rtol=0), (got - want).abs().max()
    cfg_out = prepared.adapter_config
    assert not cfg_out.get("rank_pattern") and not cfg_out.get("alpha_pattern") and not cfg_out.get("use_rslora")
    ranks = {t.shape[-2] for n, t in prepared.tensors.items() if n.endswith(".lora_A.weight")}
    assert ranks == {cfg_out["r"]}, ranks


def test_target_modules_pass_sglang_subset_check(k3):
    """The prepared config's target_modules, normalised by SGLang itself, are a subset of what the engine
    flag (lora_target_modules of the same leaves) normalises to: SGLang's pool accepts the adapter; the
    HF leaves as written by the trainer (w1/w3/w2) would be refused."""
    from sglang.srt.lora.utils import get_normalized_target_modules

    _, cfg, _ = k3
    ad = random_adapter(
        cfg, LoraSpec(rank=8, alpha=16.0, target_modules=K3_LEAVES, expert_layout="shared_outer"), seed=1
    )
    engine = get_normalized_target_modules(lora_target_modules(K3_LEAVES))
    prepared = prepare_adapter(ad, cfg).adapter_config["target_modules"]
    assert get_normalized_target_modules(prepared) <= engine, (prepared, engine)
    assert not get_normalized_target_modules(ad.adapter_config["target_modules"]) <= engine


def test_kda_projection_refused_by_name(k3):
    """LoRA on a KDA projection SGLang fuses (q_proj of a KDA layer) is refused naming the tensor."""
    _, cfg, _ = k3
    ad = random_adapter(cfg, LoraSpec(rank=8, alpha=8.0, target_modules=("q_proj",)), seed=0)
    with pytest.raises(AdapterRejected, match=r"layers\.\d+\.self_attn\.q_proj\.lora_A.*fused_qkvg_proj"):
        prepare_adapter(ad, cfg)


def test_out_dir_is_written_atomically(k3, tmp_path):
    """prepare_adapter(..., out_dir=) replaces a previous directory whole, leaves no staging folder behind and
    names the folder as the result's source."""
    _, cfg, _ = k3
    ad = random_adapter(cfg, LoraSpec(rank=8, alpha=16.0, target_modules=("o_proj",)), seed=2)
    out = tmp_path / "v1.sglang"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    served = prepare_adapter(ad, cfg, out_dir=str(out))
    assert served.source == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stage-")]
    assert Adapter.load(str(out)).adapter_config["target_modules"] == ["o_proj"]


def test_unprepared_config_refused(k3):
    """check_served_config refuses configs SGLang would misread (rank_pattern, rsLoRA) or refuse (HF expert
    leaves, KDA projections), naming the field; a prepared adapter's config passes."""
    from kimi_sglang_plugin.adapters import check_served_config

    _, cfg, _ = k3
    ad = random_adapter(cfg, LoraSpec(rank=16, alpha=32.0, target_modules=K3_LEAVES, normalize_moe_lora=True), seed=4)
    with pytest.raises(AdapterRejected, match="rank_pattern is set"):
        check_served_config(ad.adapter_config)
    with pytest.raises(AdapterRejected, match="use_rslora is set"):
        check_served_config({"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj"]})
    plain = random_adapter(cfg, LoraSpec(rank=8, alpha=16.0, target_modules=K3_LEAVES), seed=5)
    with pytest.raises(AdapterRejected, match=r"target_modules \['w1', 'w2', 'w3'\]"):
        check_served_config(plain.adapter_config)
    check_served_config(prepare_adapter(ad, cfg).adapter_config)


def test_prepare_adapter_takes_a_folder(k3, tmp_path):
    """prepare_adapter takes a PEFT folder, a loaded adapter or a {adapter_config, tensors} dict alike; a folder
    without an adapter, and an adapter whose rank is above the engine's --max-lora-rank, are refused with
    AdapterRejected naming the folder."""
    _, cfg, _ = k3
    ad = random_adapter(cfg, LoraSpec(rank=8, alpha=16.0, target_modules=K3_LEAVES), seed=6)
    folder = tmp_path / "v7"
    ad.save_replacing(str(folder))
    from_folder, from_object = prepare_adapter(str(folder), cfg), prepare_adapter(Adapter.load(str(folder)), cfg)
    assert from_folder.adapter_config == from_object.adapter_config
    assert sorted(from_folder.tensors) == sorted(from_object.tensors)
    assert all(torch.equal(from_folder.tensors[n], t) for n, t in from_object.tensors.items())
    with pytest.raises(AdapterRejected, match="missing"):
        prepare_adapter(tmp_path / "missing", cfg)
    as_dict = {"adapter_config": ad.adapter_config, "tensors": ad.tensors}
    assert prepare_adapter(as_dict, cfg).adapter_config == from_object.adapter_config
    with pytest.raises(AdapterRejected, match=r"v7\S*: adapter_config r=8 is above the engine's --max-lora-rank 4"):
        prepare_adapter(str(folder), cfg, max_lora_rank=4)
    assert prepare_adapter(str(folder), cfg, max_lora_rank=8).adapter_config["r"] == 8
