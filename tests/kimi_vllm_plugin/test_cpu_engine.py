"""``kimi_vllm_plugin.cpu_engine``: what every CPU vLLM engine of this project is started with: an explicit
KV-cache size from what the run needs (none on a GPU), and CPU_MLA for float32."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kimi_vllm_plugin.cpu_engine import (
    FLOAT32_MLA_BACKEND,
    MIN_BYTES,
    cpu_engine_kwargs,
    cpu_kv_cache_kwargs,
    kv_cache_bytes,
)

GiB = 1 << 30


@pytest.mark.parametrize("model", ["k2", "k25", "k3"])
def test_size_covers_the_run_and_fits_a_small_node(tiny_ckpt, model):
    """The bytes cover every sequence's MLA latent in bf16 on every layer, and leave most of an 8 GiB node free."""
    from kimi_core.config import load_config

    cfg = load_config(tiny_ckpt(model))
    n = kv_cache_bytes(cfg, max_model_len=64, max_num_seqs=64)
    latent = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * 64 * 64
    assert latent < n <= 1 * GiB and n >= MIN_BYTES
    assert kv_cache_bytes(cfg, 4096, 64) > kv_cache_bytes(cfg, 64, 64)  # grows with the run
    with pytest.raises(ValueError, match="max_model_len=0"):
        kv_cache_bytes(cfg, 0, 1)


def test_kv_cache_size_on_cpu_only(tiny_ckpt, monkeypatch):
    """On the CPU platform the engine kwargs carry kv_cache_memory_bytes; on a GPU platform nothing is set."""
    from vllm.platforms import current_platform

    ckpt = tiny_ckpt("k2")
    if current_platform.is_cpu():
        assert set(cpu_kv_cache_kwargs(ckpt, 64, 8)) == {"kv_cache_memory_bytes"}
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert cpu_kv_cache_kwargs(ckpt, 64, 8) == {}
    assert cpu_engine_kwargs(ckpt, 64, 8, "float32") == {}


def test_float32_engines_ask_for_cpu_mla(tiny_ckpt):
    """float32 (either spelling) gets the KV-cache size and CPU_MLA; bf16 only the KV-cache size, and the backend
    name is one vLLM's attention config accepts."""
    from vllm.config.attention import AttentionConfig

    ckpt = tiny_ckpt("k2")
    kv = cpu_kv_cache_kwargs(ckpt, 64, 4)
    assert kv and set(kv) == {"kv_cache_memory_bytes"}
    for dtype in ("float32", "torch.float32", "float"):
        assert cpu_engine_kwargs(ckpt, 64, 4, dtype) == {**kv, "attention_backend": FLOAT32_MLA_BACKEND}
    assert cpu_engine_kwargs(ckpt, 64, 4, "bfloat16") == kv
    assert AttentionConfig(backend=FLOAT32_MLA_BACKEND).backend.name == "CPU_MLA"
