"""``kimi_vllm_plugin.adapters.prepare_adapter(adapter, config)``: the vLLM-served form of an adapter (per-expert
2-D experts, per-module scaling folded into ``lora_B``) means the same update as the input, and a bad adapter is
refused with :class:`kimi_core.errors.AdapterRejected` naming the folder, the tensor and what was expected. No
engine: the oracle is :func:`kimi_core.lora.load_adapter`'s per-module factors of the input adapter."""

from __future__ import annotations

import os
import re

import pytest
import torch
from vllm_adapters import MAX_LORA_RANK, spec, write_all

from kimi_core.config import load_config
from kimi_core.errors import AdapterRejected
from kimi_core.lora import Adapter, convert_layout, load_adapter, random_adapter
from kimi_vllm_plugin.adapters import prepare_adapter

_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.lora_[AB]\.weight$")


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    from kimi_core.checkpoint.tiny import make_tiny

    return load_config(make_tiny("k2", tmp_path_factory.mktemp("k2"), quant="int4"))


@pytest.fixture(scope="module")
def bad_adapters(k2, tmp_path_factory):
    return write_all(k2, str(tmp_path_factory.mktemp("adapters")))


@pytest.mark.parametrize(
    "layout,stored",
    [("per_expert", None), ("shared_outer", None), ("per_expert", "per_expert_3d"), ("per_expert", "stacked")],
)
def test_prepared_adapter_is_the_same_update_in_vllm_form(k2, layout, stored):
    """Every module's merged update ``scaling * B @ A`` is unchanged (experts at capacity-normalised rank through
    rank_pattern); the result has numbered 2-D expert tensors only, one global scaling and no patterns."""
    ad = random_adapter(k2, spec(layout), seed=5, b_std=0.3)
    if stored:
        ad = convert_layout(ad, k2, stored)
    before = {n: t.clone() for n, t in ad.tensors.items()}
    got = prepare_adapter(ad, k2, max_lora_rank=MAX_LORA_RANK)
    assert {n: t for n, t in ad.tensors.items()}.keys() == before.keys()
    assert all(torch.equal(ad.tensors[n], t) for n, t in before.items())  # the input is not modified
    assert not got.adapter_config.get("rank_pattern") and not got.adapter_config.get("alpha_pattern")
    experts = [n for n in got.tensors if ".experts." in n and ".shared_experts." not in n]
    assert experts and all(_EXPERT.search(n) and got.tensors[n].dim() == 2 for n in experts)
    # served as vLLM 0.26 reads it: every module at the one scaling lora_alpha / r, whatever its own rank
    scale = got.adapter_config["lora_alpha"] / got.adapter_config["r"]
    served = {}
    for n, t in got.tensors.items():
        if n.endswith(".lora_A.weight"):
            module = n.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            B = got.tensors[n.replace(".lora_A.", ".lora_B.")]
            served[module] = scale * (B.double() @ t.double())
    want = load_adapter(ad, k2)
    expected = {m: want.dense(m).delta_weight(torch.float64) for m in want.modules()}
    for moe in want.moe_modules():
        for e in range(k2.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                expected[f"{moe}.experts.{e}.{proj}"] = want.expert(moe, e, proj).delta_weight(torch.float64)
    assert served.keys() == expected.keys()
    for m, w in expected.items():
        torch.testing.assert_close(served[m], w, rtol=1e-6, atol=1e-7, msg=m)


def test_folder_in_folder_out(k2, tmp_path):
    """A PEFT folder in, ``out_dir`` written (and rewritten) whole: the folder reloads to the returned tensors."""
    src = random_adapter(k2, spec("shared_outer"), seed=6).save(tmp_path / "src")
    got = prepare_adapter(src, k2, max_lora_rank=MAX_LORA_RANK, out_dir=tmp_path / "out")
    assert got.source == os.fspath(tmp_path / "out")
    again = Adapter.load(tmp_path / "out")
    assert again.tensors.keys() == got.tensors.keys()
    assert all(torch.equal(again.tensors[n], t) for n, t in got.tensors.items())
    prepare_adapter(src, k2, max_lora_rank=MAX_LORA_RANK, out_dir=tmp_path / "out")  # replaced, not merged
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.parametrize(
    "bad,match",
    [
        ("rank32", r"rank 32 > max_rank 16"),
        ("unknown", r"foo_proj.*unknown module"),
        ("nan", r"NaN"),
        ("missing", r"does-not-exist.*not found"),
        (
            "kv_b",
            r"/kv_b: \S+kv_b_proj\.lora_[AB]\.weight: vLLM serves no LoRA on kv_b_proj.*"
            r"exclude_modules=\['kv_b_proj'\]",
        ),
    ],
)
def test_bad_adapter_rejected_naming_folder_and_tensor(k2, bad_adapters, tmp_path, bad, match):
    """Each bad adapter of the engine tests is refused before any engine sees it, naming where and why."""
    with pytest.raises(AdapterRejected, match=match):
        prepare_adapter(bad_adapters[bad], k2, max_lora_rank=MAX_LORA_RANK, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
