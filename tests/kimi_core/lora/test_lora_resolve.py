"""load_adapter: every input form, the fixed LoraFactors contract, and clear rejections."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kimi_core.lora import AdapterError, LoraSpec, load_adapter, random_adapter

P = "base_model.model."


def test_dense_and_expert_factors_from_directory(tmp_path, k3_tiny):
    """A saved PEFT directory resolves to the stored tensors in fp32 with scaling alpha/r (experts alpha/(r//k))."""
    c = k3_tiny
    spec = LoraSpec(rank=4, alpha=6, normalize_moe_lora=True)
    ad = random_adapter(c, spec, seed=2, layout="per_expert", dtype=torch.bfloat16)
    ad.save(tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a")) == ["adapter_config.json", "adapter_model.safetensors"]
    res = load_adapter(str(tmp_path / "a"), c)
    m = "language_model.model.layers.1.self_attn.q_a_proj"
    f = res.dense(m)
    assert f.A.dtype == torch.float32 and f.B.dtype == torch.float32
    assert torch.equal(f.A, ad.tensors[f"{P}{m}.lora_A.weight"].float())
    assert torch.equal(f.B, ad.tensors[f"{P}{m}.lora_B.weight"].float())
    assert f.scaling == 6 / 4
    assert res.dense("model.layers.1.self_attn.q_a_proj") is f  # lm prefix added when missing
    assert res.dense("language_model.model.layers.1.self_attn.gate") is None  # not LoRA-targeted: None
    moe = "language_model.model.layers.2.block_sparse_moe"
    fe = res.expert(moe, 3, "w3")
    assert fe.A.shape == (2, 24) and fe.B.shape == (12, 2) and fe.scaling == 6 / 2
    assert torch.equal(fe.B, ad.tensors[f"{P}{moe}.experts.3.w3.lora_B.weight"].float())
    assert torch.equal(res.expert(moe, 3, "up_proj").A, fe.A)  # K2 projection names map to K3's
    x = torch.randn(5, 24, dtype=torch.float64)
    want = fe.scaling * (x @ fe.A.double().T) @ fe.B.double().T
    torch.testing.assert_close(fe.delta(x), want)
    torch.testing.assert_close(fe.delta_weight(torch.float64), fe.scaling * fe.B.double() @ fe.A.double())


def test_input_forms_agree(k2_tiny):
    """An Adapter, a {'adapter_config','tensors'} dict and a plain dict with adapter_config= resolve alike."""
    ad = random_adapter(k2_tiny, LoraSpec(rank=2), seed=4, layout="stacked")
    a = load_adapter(ad, k2_tiny)
    b = load_adapter({"adapter_config": ad.adapter_config, "tensors": ad.tensors}, k2_tiny)
    stripped = {k[len(P) :]: v for k, v in ad.tensors.items()}  # names without base_model.model.
    c = load_adapter(stripped, k2_tiny, adapter_config=ad.adapter_config)
    for r in (b, c):
        assert r.layout == a.layout == "stacked"
        assert torch.equal(
            r.expert("model.layers.1.mlp", 5, "down_proj").B, a.expert("model.layers.1.mlp", 5, "down_proj").B
        )
    with pytest.raises(AdapterError, match="adapter_config="):
        load_adapter(stripped, k2_tiny)


def _bad(ad, name, fn):
    t = dict(ad.tensors)
    fn(t, name)
    return {"adapter_config": ad.adapter_config, "tensors": t, "source": "/x/adapter_model.safetensors"}


@pytest.fixture()
def k2_ad(k2_tiny):
    return random_adapter(k2_tiny, LoraSpec(rank=4, alpha=4), seed=0, layout="per_expert")


QA = f"{P}model.layers.1.self_attn.q_a_proj.lora_A.weight"
QB = f"{P}model.layers.1.self_attn.q_a_proj.lora_B.weight"
EA = f"{P}model.layers.2.mlp.experts.4.down_proj.lora_A.weight"

BAD = {
    "unknown module": (
        lambda t, n: t.update(
            {
                f"{P}model.layers.1.self_attn.q_proj.lora_A.weight": t[QA],
                f"{P}model.layers.1.self_attn.q_proj.lora_B.weight": t[QB],
            }
        ),
        "q_proj.lora_A.weight'.*unknown module",
    ),
    "unknown layer": (
        lambda t, n: t.update({f"{P}model.layers.9.self_attn.q_a_proj.lora_A.weight": t[QA]}),
        "layers.9.*unknown module",
    ),
    "expert out of range": (lambda t, n: t.update({EA.replace(".4.", ".6."): t[EA]}), r"expert 6 outside \[0, 6\)"),
    "shape mismatch": (lambda t, n: t.update({QB: torch.zeros(7, 4)}), r"q_a_proj.lora_A.weight'.*shape mismatch"),
    "nan": (lambda t, n: t[QB].view(-1).__setitem__(3, float("nan")), r"q_a_proj.lora_B.weight'.*NaN"),
    "inf": (lambda t, n: t.update({EA: t[EA].clone().fill_(float("inf"))}), r"experts.4.down_proj.lora_A.weight'.*Inf"),
    "A without B": (lambda t, n: t.pop(QB), r"q_a_proj.lora_A.weight'.*lora_A without lora_B"),
    "B without A": (lambda t, n: t.pop(QA), r"q_a_proj.lora_B.weight'.*lora_B without lora_A"),
    "rank vs config": (
        lambda t, n: t.update({QA: t[QA][:2], QB: t[QB][:, :2]}),
        r"rank 2 but adapter_config gives r=4",
    ),
    "not a lora name": (lambda t, n: t.update({"model.layers.1.mlp.gate.weight": t[QA]}), "not a LoRA weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_rejections_name_file_and_tensor(k2_tiny, k2_ad, case):
    """Each malformed adapter is rejected before use with an AdapterError naming the file and the tensor."""
    fn, msg = BAD[case]
    with pytest.raises(AdapterError, match=msg) as ei:
        load_adapter(_bad(k2_ad, None, fn), k2_tiny)
    assert "/x/adapter_model.safetensors" in str(ei.value)


def test_max_rank_and_missing_files(tmp_path, k3_tiny):
    """A rank above max_rank, a missing safetensors file and a pickled-only adapter are rejected by name."""
    ad = random_adapter(k3_tiny, LoraSpec(rank=8), layout="per_expert")
    with pytest.raises(AdapterError, match=r"rank 8 > max_rank 4"):
        load_adapter(ad, k3_tiny, max_rank=4)
    load_adapter(ad, k3_tiny, max_rank=8)
    d = tmp_path / "ad"
    ad.save(d)
    os.remove(d / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"ad/adapter_model.safetensors: file not found"):
        load_adapter(str(d), k3_tiny)
    (d / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(AdapterError, match="pickled"):
        load_adapter(str(d), k3_tiny)
    os.remove(d / "adapter_config.json")
    with pytest.raises(AdapterError, match=r"adapter_config.json: file not found"):
        load_adapter(str(d), k3_tiny)
    with pytest.raises(AdapterError, match="not found"):
        load_adapter(str(tmp_path / "missing"), k3_tiny)


def test_mixed_forms_in_one_moe_block_rejected(k2_tiny):
    """Per-expert names and stacked names in the same MoE block are refused."""
    a = random_adapter(k2_tiny, LoraSpec(rank=2), layout="per_expert")
    s = random_adapter(k2_tiny, LoraSpec(rank=2), layout="stacked")
    t = dict(a.tensors)
    t.update({k: v for k, v in s.tensors.items() if "layers.1.mlp.experts.base_layer" in k})
    with pytest.raises(AdapterError, match="mixes expert forms"):
        load_adapter({"adapter_config": a.adapter_config, "tensors": t}, k2_tiny)


def test_saved_files_are_atomic_and_readable(tmp_path, k2_tiny):
    """save() leaves no temp files and writes JSON that the adapter_config reader accepts."""
    a = random_adapter(k2_tiny, LoraSpec(rank=2), layout="per_expert_3d")
    a.save(tmp_path)
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    assert json.load(open(tmp_path / "adapter_config.json"))["peft_type"] == "LORA"
