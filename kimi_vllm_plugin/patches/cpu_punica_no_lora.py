"""Patch ``cpu_punica_no_lora``: tokens without a LoRA get no LoRA delta on the CPU (the row is :data:`ENTRY`)."""

from __future__ import annotations

import functools

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "OPS", "apply"]

ENTRY = PatchEntry(
    name="cpu_punica_no_lora",
    target="vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink",
    host="vllm",
    versions=">=0.32,<0.33",
    why="vLLM's torch punica ops (vllm/lora/ops/torch_ops/lora_ops.py) select weights with "
    "lora_weights[lora_indices]; a token without an adapter has index -1, which Python indexing turns into the last "
    "slot, so once the last of max_loras slots holds an adapter every base-model request in the same batch is "
    "served with that adapter's dense deltas (1.6 nats of prompt-logprob error on the tiny K2)",
    how="wrap bgmv_shrink, bgmv_expand and bgmv_expand_slice where vLLM looks them up (the op module and "
    "vllm.lora.punica_wrapper.punica_cpu): the wrappers zero the input rows of tokens with index -1 and clamp their "
    "index to 0, which makes their delta exactly zero. Idempotent; applied with lora_layers",
    upstream="not reported yet; a mask of index -1 in the torch ops fixes it",
    remove_when="vLLM's torch punica ops mask index -1",
    expect="type:function",
)

#: op name -> position of its token-indices argument
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


def apply() -> None:
    """Wrap the three bgmv ops in the op module and the CPU punica wrapper; idempotent.

    :raises PatchTargetError: an op is missing in the installed vLLM.
    """
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pc

    for mod in (ops, pc):
        for name, pos in OPS.items():
            fn = getattr(mod, name, None)
            if fn is None:
                raise PatchTargetError(
                    f"patch ledger entry {ENTRY.name!r}: {mod.__name__}.{name} is missing; "
                    "kimi_vllm_plugin/patches/cpu_punica_no_lora.py needs updating"
                )
            setattr(mod, name, _masked(fn, pos))
