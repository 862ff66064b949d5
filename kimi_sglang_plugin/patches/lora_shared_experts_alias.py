"""sgl-project/sglang#37704 item 1: shared-expert LoRA buffers sized from K3's own config field.

SGLang's LoRA sizing reads only ``n_shared_experts`` (``lora/utils.get_hidden_dim``'s defaults,
``lora/mem_pool._get_num_shared_experts``, ``lora/lora.py``); K3 configs say ``num_shared_experts``, so the
shared experts' gate_up / down LoRA buffers get the dense MLP width. One alias on the config fixes every
reader (K3's model code reads ``num_shared_experts`` only).
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.config_alias import alias_field
from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, PR_37704, HookPatch

__all__ = ["ENTRY", "alias_num_shared_experts"]

#: this patch's ledger row
ENTRY = HookPatch(
    name="lora_shared_experts_alias",
    target="sglang.srt.configs.kimi_linear.KimiLinearConfig.__init__",
    host=HOST,
    hook="after",
    fn=f"{__name__}:alias_num_shared_experts",
    why="LoRA sizing reads only n_shared_experts (lora/utils.get_hidden_dim's defaults, "
    "lora/mem_pool._get_num_shared_experts, lora/lora.py); K3 configs say num_shared_experts, so "
    "shared-expert gate_up/down LoRA buffers get the dense MLP width",
    how="AFTER on the config constructor: set n_shared_experts = num_shared_experts when absent "
    "(one alias fixes every reader; K3 model code reads num_shared_experts only)",
    upstream=PR_37704 + " item 1",
    remove_when="SGLang LoRA reads num_shared_experts (or the PR lands in a release we pin)",
    versions=BOTH,
)


def alias_num_shared_experts(result, config, *args, **kwargs):
    """After ``KimiLinearConfig.__init__``: ``n_shared_experts = num_shared_experts`` when unset."""
    alias_field(config, "num_shared_experts", "n_shared_experts")
    return None
