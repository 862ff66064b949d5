"""Patch ``moe_block``: build DeepSeek decoder layers with our CPU MoE block (ledger in ``__init__``)."""

from __future__ import annotations

import contextlib

__all__ = ["swap_moe_block"]


@contextlib.contextmanager
def swap_moe_block(moe_cls):
    """Within the block, ``deepseek_v2.DeepseekV2MoE`` is ``moe_cls``; restored on exit (also on error)."""
    import vllm.model_executor.models.deepseek_v2 as dv2

    if not hasattr(dv2, "DeepseekV2MoE"):
        raise RuntimeError("kimi_vllm_plugin: vllm.model_executor.models.deepseek_v2.DeepseekV2MoE is missing; "
                           "the CPU MoE patch (kimi_vllm_plugin/patches/moe_block.py) needs updating")
    orig = dv2.DeepseekV2MoE
    dv2.DeepseekV2MoE = moe_cls
    try:
        yield
    finally:
        dv2.DeepseekV2MoE = orig
