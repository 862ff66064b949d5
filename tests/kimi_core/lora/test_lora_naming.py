"""HF/PEFT names and shapes of the LoRA targets, checked against shapes written out by hand."""

from __future__ import annotations

import pytest

from kimi_core.lora import LoraSpec, iter_targets, target_shapes
from kimi_core.lora.naming import lora_names, parse_lora_name


def test_k2_names_and_shapes(k2_tiny):
    """K2: MLA on every layer, dense MLP on layer 0, shared + routed experts under mlp.* from layer 1."""
    c = k2_tiny
    ts = target_shapes(c, LoraSpec(rank=4))
    H, n = 48, 2
    assert ts["model.layers.0.self_attn.q_a_proj"] == (H, 24, 4, False)
    assert ts["model.layers.0.self_attn.q_b_proj"] == (24, n * (8 + 4), 4, False)
    assert ts["model.layers.2.self_attn.kv_a_proj_with_mqa"] == (H, 16 + 4, 4, False)
    assert ts["model.layers.2.self_attn.kv_b_proj"] == (16, n * (8 + 8), 4, False)
    assert ts["model.layers.2.self_attn.o_proj"] == (n * 8, H, 4, False)
    assert ts["model.layers.0.mlp.gate_proj"] == (H, 40, 4, False)
    assert ts["model.layers.0.mlp.down_proj"] == (40, H, 4, False)
    assert ts["model.layers.1.mlp.shared_experts.up_proj"] == (H, 20, 4, False)
    assert ts["model.layers.1.mlp.experts.5.gate_proj"] == (H, 20, 4, True)
    assert ts["model.layers.2.mlp.experts.0.down_proj"] == (20, H, 4, True)
    assert "model.layers.0.mlp.experts.0.gate_proj" not in ts
    assert not any("g_proj" in k or "indexer" in k for k in ts)
    assert sum(1 for k in ts if ".experts." in k and "shared" not in k) == 2 * 6 * 3


def test_k3_names_and_shapes(k3_tiny):
    """K3: KDA on kda_layers, MLA + output gate elsewhere, latent projections and w1/w3/w2 experts."""
    c = k3_tiny
    ts = target_shapes(c, LoraSpec(rank=4, normalize_moe_lora=True))
    p = "language_model.model.layers."
    H, P = 40, 2 * 8
    assert ts[p + "0.self_attn.q_proj"] == (H, P, 4, False)  # layer 0 (1-based 1) is KDA
    assert ts[p + "0.self_attn.f_a_proj"] == (H, 8, 4, False)
    assert ts[p + "0.self_attn.f_b_proj"] == (8, P, 4, False)
    assert ts[p + "0.self_attn.b_proj"] == (H, 2, 4, False)
    assert ts[p + "0.self_attn.g_proj"] == (H, P, 4, False)
    assert ts[p + "0.self_attn.o_proj"] == (P, H, 4, False)
    assert p + "0.self_attn.q_a_proj" not in ts
    assert ts[p + "1.self_attn.q_a_proj"] == (H, 20, 4, False)  # 1-based 2 is MLA
    assert ts[p + "1.self_attn.g_proj"] == (H, 2 * 6, 4, False)
    assert ts[p + "0.mlp.up_proj"] == (H, 36, 4, False)
    assert ts[p + "1.block_sparse_moe.shared_experts.gate_proj"] == (H, 12 * 2, 4, False)
    assert ts[p + "1.block_sparse_moe.routed_expert_down_proj"] == (H, 24, 4, False)
    assert ts[p + "1.block_sparse_moe.routed_expert_up_proj"] == (24, H, 4, False)
    assert ts[p + "3.block_sparse_moe.experts.4.w1"] == (24, 12, 2, True)  # rank 4 // top-2
    assert ts[p + "3.block_sparse_moe.experts.4.w2"] == (12, 24, 2, True)


def test_k3_real_config_shapes(k3_real):
    """The real K3 config gives kimi_arch.md's shapes: 24 MLA and 69 KDA layers, latent 3584 experts."""
    spec = LoraSpec(rank=32, target_modules=("q_b_proj", "kv_b_proj", "f_b_proj", "g_proj", "routed_expert_up_proj"))
    ts = {t.module: t for t in iter_targets(k3_real, spec) if t.kind != "expert"}
    p = "language_model.model.layers."
    assert (ts[p + "3.self_attn.q_b_proj"].out_features, ts[p + "3.self_attn.q_b_proj"].in_features) == (96 * 192, 1536)
    assert (ts[p + "92.self_attn.kv_b_proj"].out_features, ts[p + "92.self_attn.kv_b_proj"].in_features) == (
        96 * 256,
        512,
    )
    assert (ts[p + "0.self_attn.f_b_proj"].out_features, ts[p + "0.self_attn.f_b_proj"].in_features) == (12288, 128)
    assert ts[p + "3.self_attn.g_proj"].out_features == 96 * 128
    mla = {t.layer for t in ts.values() if t.kind == "mla"}
    kda = {t.layer for t in ts.values() if t.kind == "kda"}
    assert len(mla) == 24 and len(kda) == 69 and 92 in mla and 0 in kda and 3 in mla
    assert sum(1 for t in ts.values() if t.kind == "latent") == 92


def test_selection_exclude_regex_and_indexer(k31_tiny):
    """List targets match at a dot boundary, exclusions win, regexes match whole names, the indexer is opt-in."""
    c = k31_tiny
    assert not any("indexer" in k for k in target_shapes(c, LoraSpec(rank=2)))
    ts = target_shapes(c, LoraSpec(rank=2, target_modules=("wq_b", "wk", "weights_proj")))
    assert set(k.rsplit(".", 1)[1] for k in ts) == {"wq_b", "wk", "weights_proj"}
    assert ts["language_model.model.layers.1.self_attn.indexer.wq_b"] == (20, 2 * 8, 2, False)
    kda_only = target_shapes(c, LoraSpec(rank=2, target_modules=("q_proj", "k_proj", "v_proj", "f_a_proj")))
    assert {k.split(".")[3] for k in kda_only} == {"0", "2"}
    ex = target_shapes(c, LoraSpec(rank=2, exclude_modules=("w1", "w3", "w2", "g_proj")))
    assert not any(k.endswith((".w1", ".w2", ".w3", "g_proj")) for k in ex)
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj" in ex
    rx = target_shapes(c, LoraSpec(rank=2, target_modules=r".*layers\.3\..*experts\.\d+\.w1"))
    assert len(rx) == 5 and all(".layers.3." in k for k in rx)


def test_parse_names_all_forms(k25_tiny):
    """Tensor names of every form parse to the module, expert and projection; prefixes are normalised."""
    c = k25_tiny
    a, b = lora_names("language_model.model.layers.1.mlp.experts.3.up_proj")
    pa = parse_lora_name(c, a)
    assert (pa.form, pa.moe, pa.expert, pa.proj, pa.ab) == (
        "per_expert",
        "language_model.model.layers.1.mlp",
        3,
        "up_proj",
        "A",
    )
    assert parse_lora_name(c, b).ab == "B"
    p3 = parse_lora_name(c, "model.layers.2.mlp.experts.down_proj.lora_B.weight")  # no lm prefix, no PEFT prefix
    assert (p3.form, p3.moe, p3.proj) == ("expert_3d", "language_model.model.layers.2.mlp", "down_proj")
    ps = parse_lora_name(c, "base_model.model.language_model.model.layers.2.mlp.experts.base_layer.lora_A.weight")
    assert (ps.form, ps.proj) == ("stacked", "gate_up_proj")
    pd = parse_lora_name(c, "base_model.model.language_model.model.layers.2.mlp.experts.lora_A.weight")
    assert (pd.form, pd.proj) == ("stacked", "down_proj")
    sh = parse_lora_name(c, "base_model.model.language_model.model.layers.2.mlp.shared_experts.gate_proj.lora_A.weight")
    assert sh.form == "dense"
    assert parse_lora_name(c, "model.layers.2.mlp.gate.weight") is None


@pytest.mark.parametrize("family", ["k2", "k25", "k3", "k31"])
def test_prefix_per_family(family, k2_tiny, k25_tiny, k3_tiny, k31_tiny):
    """language_model. prefixes every name of K2.5 / K3 / K3.1 and none of K2 text."""
    c = {"k2": k2_tiny, "k25": k25_tiny, "k3": k3_tiny, "k31": k31_tiny}[family]
    names = list(target_shapes(c, LoraSpec(rank=2)))
    want = "" if family == "k2" else "language_model."
    assert all(n.startswith(want + "model.layers.") for n in names)
