"""Whole-model oracle: K2.x vs transformers' DeepseekV3, decode == full, fp32 vs fp64, loading, hidden states, speed."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from ref_helpers import tiny
from utils import assert_close, rel_rms_error

from kimi_core.reference import KimiReferenceModel, load_reference_model

MODELS = [pytest.param(m, id=m) for m in ("k2", "k25", "k3", "k31")]


def _dequantized_hf_dir(ckpt: str, out: str) -> str:
    """Write ``ckpt`` with every packed expert dequantized to a plain fp32 ``.weight`` (the BF16->fp32 masters)."""
    from safetensors.torch import save_file

    from kimi_core.checkpoint import CheckpointReader

    r = CheckpointReader(ckpt)
    sd = {}
    for k in r.keys():
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            sd[f"{m}.weight"] = r.get_weight(m, torch.float32)
        elif not k.endswith((".weight_scale", ".weight_shape")):
            sd[k] = r.get(k).float()
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    cfg.pop("quantization_config", None)
    cfg["model_type"] = "deepseek_v3"  # transformers' name for the architecture K2's config declares
    os.makedirs(out, exist_ok=True)
    save_file(sd, os.path.join(out, "model.safetensors"))
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return out


def test_k2_matches_transformers_deepseek_v3(tiny_ckpt, tmp_path):
    """K2 logits equal transformers' DeepseekV3ForCausalLM on the same tiny INT4 checkpoint's dequantized fp32 masters (<= 1e-5).

    The MLA latent norms use rms_norm_eps here (vLLM/SGLang) and 1e-6 in transformers: the test
    checks both ways, by setting transformers' latent eps to rms_norm_eps and by overriding ours to 1e-6.
    """
    from transformers import DeepseekV3ForCausalLM

    ckpt = tiny_ckpt("k2")
    hf_dir = _dequantized_hf_dir(ckpt, str(tmp_path / "hf"))
    hf, info = DeepseekV3ForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(0))
    ours = load_reference_model(ckpt)
    with torch.no_grad():
        ref_1e6 = hf(ids).logits
        assert_close(
            "k2 vs transformers (latent eps 1e-6 both)",
            ref_1e6,
            load_reference_model(ckpt, mla_latent_eps=1e-6)(ids),
            1e-5,
        )
        eps = ours.config.rms_norm_eps
        for layer in hf.model.layers:
            layer.self_attn.q_a_layernorm.variance_epsilon = eps
            layer.self_attn.kv_a_layernorm.variance_epsilon = eps
        ref = hf(ids).logits
    assert_close("k2 vs transformers (latent eps = rms_norm_eps both)", ref, ours(ids), 1e-5)
    print(f"eps convention gap (rms_norm_eps vs 1e-6): {rel_rms_error(ref_1e6, ref):.2e}")


def test_small_k2_matches_transformers_deepseek_v3(tmp_path):
    """``make-tiny --size small`` (the GPU demos' K2: hidden 1024, the release's MLA head sizes, 64 INT4 experts
    top-8) is a DeepseekV3 that transformers loads without a missing or extra key and whose logits ours equal
    (<= 1e-5, fp32 masters, latent eps set alike)."""
    from transformers import DeepseekV3ForCausalLM

    from kimi_core.checkpoint.tiny import make_tiny
    from kimi_core.release_configs import k2_release_config

    ckpt = make_tiny("k2", str(tmp_path / "small"), size="small", layers=3, max_shard_bytes=256 * 2**20)
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    release = k2_release_config()
    for k in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "num_experts_per_tok",
    ):
        assert cfg[k] == release[k], k
    assert cfg["hidden_size"] >= 1024 and cfg["n_routed_experts"] >= 64
    hf, info = DeepseekV3ForCausalLM.from_pretrained(
        _dequantized_hf_dir(ckpt, str(tmp_path / "hf")),
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    ours = load_reference_model(ckpt)
    for layer in hf.model.layers:
        layer.self_attn.q_a_layernorm.variance_epsilon = ours.config.rms_norm_eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = ours.config.rms_norm_eps
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close("small k2 vs transformers", hf(ids).logits, ours(ids), 1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_decode_equals_full_forward(model, tiny_models):
    """prefill + step-by-step decode (MLA/indexer KV cache, KDA conv + recurrent state) gives the full forward's logits (<= 1e-5)."""
    _, _, m = tiny_models(model)
    ids = torch.randint(0, 1024, (2, 18), generator=torch.Generator().manual_seed(1))
    full = m(ids)
    state = m.prefill(ids[:, :12])
    outs = [state.logits]
    for t in range(12, ids.shape[1]):
        logits, state = m.step(state, ids[:, t])
        outs.append(logits)
    got = torch.stack(outs, 1)
    assert_close(f"{model} decode vs full", full[:, 11:], got, 1e-5)
    assert state.pos == ids.shape[1]


@pytest.mark.parametrize("model", MODELS)
def test_fp32_matches_float64(model, tiny_models):
    """The fp32 model equals the same code run in float64 (the recomputation of every formula) to 1e-5."""
    cfg, sd, m32 = tiny_models(model)
    m64 = KimiReferenceModel.from_state_dict(cfg, sd, dtype=torch.float64)
    ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(2))
    assert_close(f"{model} fp32 vs fp64", m64(ids), m32(ids), 1e-5)


def test_kda_modes_agree(tiny_models):
    """K3 with chunked KDA equals K3 with the recurrent KDA loop (T = 100 crosses a chunk boundary)."""
    cfg, sd, m = tiny_models("k3")
    rec = KimiReferenceModel.from_state_dict(cfg, sd, kda_mode="recurrent")
    ids = torch.randint(0, 1024, (1, 100), generator=torch.Generator().manual_seed(3))
    assert_close("chunk vs recurrent model", rec(ids), m(ids), 1e-5)


@pytest.mark.parametrize("model", [pytest.param("k2", id="k2"), pytest.param("k31", id="k31")])
def test_load_from_disk_equals_state_dict(model, tiny_ckpt, tiny_models):
    """load_reference_model(make_tiny dir) gives exactly the logits of the in-memory state dict model."""
    _, _, m = tiny_models(model)
    ids = torch.randint(0, 1024, (1, 12))
    assert torch.equal(load_reference_model(tiny_ckpt(model))(ids), m(ids))


def test_k25_equals_k2_with_same_weights():
    """K2.5 (weights under language_model.) computes exactly what K2 computes with the same tensors."""
    cfg2, sd2 = tiny("k2", quant="none")
    cfg25, sd25 = tiny("k25", quant="none")
    assert set(sd25) == {f"language_model.{k}" for k in sd2}
    ids = torch.randint(0, 1024, (1, 10))
    a = KimiReferenceModel.from_state_dict(cfg2, sd2)(ids)
    b = KimiReferenceModel.from_state_dict(cfg25, {f"language_model.{k}": v for k, v in sd2.items()})(ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("model", MODELS)
def test_hidden_states_and_logprobs(model, tiny_models):
    """return_hidden gives L+1 [B, T, H] states (embeddings first); logprobs equal log_softmax(logits) at the targets."""
    _, _, m = tiny_models(model)
    ids = torch.randint(0, 1024, (2, 9))
    logits, hidden = m(ids, return_hidden=True)
    assert len(hidden) == m.config.num_hidden_layers + 1
    assert all(h.shape == (2, 9, m.config.hidden_size) for h in hidden)
    assert torch.equal(hidden[0], m.weights.weight(m.embed_name)[ids])
    lp = m.logprobs(ids[:, :-1], ids[:, 1:])
    ref = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert_close("logprobs", ref, lp, 1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_forward_256_tokens_speed(model, tiny_models):
    """A tiny model's forward over 256 tokens is fast on the CPU (measured and printed, not asserted)."""
    _, _, m = tiny_models(model)
    ids = torch.randint(0, 1024, (1, 256))
    m(ids[:, :4])  # warm the weight cache
    t0 = time.perf_counter()
    m(ids)
    print(f"{model}: 256-token forward {time.perf_counter() - t0:.3f} s ({torch.get_num_threads()} threads)")
