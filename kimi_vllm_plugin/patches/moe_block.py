"""Patch ``moe_block``: DeepSeek decoder layers build our CPU MoE block (the row is :data:`ENTRY`)."""

from __future__ import annotations

import contextlib

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "swap_moe_block"]

ENTRY = PatchEntry(
    name="moe_block",
    target="vllm.model_executor.models.deepseek_v2.DeepseekV2MoE",
    host="vllm",
    versions=">=0.32,<0.33",
    why="DeepseekV2DecoderLayer.__init__ builds its MoE block by this module global; on the CPU the K2.x models "
    "need kimi_vllm_plugin.models.cpu_moe.KimiCpuMoE there instead, without copying the decoder layer",
    how="a context manager swaps the global while our model's upstream __init__ runs and restores it afterwards, "
    "also on error (construction is single-threaded in a worker)",
    upstream="none; a moe_cls argument on DeepseekV2DecoderLayer would remove it",
    remove_when="DeepseekV2DecoderLayer takes a MoE block class, or vLLM's CPU fused-MoE LoRA works",
    expect="type:type",
)


@contextlib.contextmanager
def swap_moe_block(moe_cls):
    """Within the block, ``deepseek_v2.DeepseekV2MoE`` is ``moe_cls``; restored on exit (also on error)."""
    import vllm.model_executor.models.deepseek_v2 as dv2

    if not hasattr(dv2, "DeepseekV2MoE"):
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r}: {ENTRY.target} is missing; "
            "kimi_vllm_plugin/patches/moe_block.py needs updating"
        )
    orig = dv2.DeepseekV2MoE
    dv2.DeepseekV2MoE = moe_cls
    try:
        yield
    finally:
        dv2.DeepseekV2MoE = orig
