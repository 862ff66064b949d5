"""``cpu_engine_kwargs``: what every CPU vLLM engine of this project is started with."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kimi_vllm_plugin.cpu_engine import FLOAT32_MLA_BACKEND, cpu_engine_kwargs  # noqa: E402
from kimi_vllm_plugin.kv_cache import cpu_kv_cache_kwargs  # noqa: E402


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
