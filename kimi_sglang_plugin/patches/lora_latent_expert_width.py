"""sgl-project/sglang#37704 item 3: routed-expert LoRA buffers at K3's latent expert width.

SGLang sizes the routed experts' LoRA buffers (``gate_up_proj_moe``, ``down_proj_moe``) with ``hidden_size``;
K3's latent MoE experts read and write ``routed_expert_hidden_size`` (half of it in the release). The hook
wraps ``lora.utils.get_hidden_dim``, what the LoRA memory pool calls in both releases (0.5.23 moved its
config defaults into ``get_default_hidden_dim``).
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, PR_37704, HookPatch

__all__ = ["ENTRY", "latent_moe_hidden_dim"]

#: this patch's ledger row
ENTRY = HookPatch(
    name="lora_latent_expert_width",
    target="sglang.srt.lora.utils.get_hidden_dim",
    host=HOST,
    hook="around",
    fn=f"{__name__}:latent_moe_hidden_dim",
    why="routed-expert LoRA buffers (gate_up_proj_moe, down_proj_moe) are sized with hidden_size; "
    "K3's latent MoE experts read and write routed_expert_hidden_size (3584 vs 7168)",
    how="AROUND get_hidden_dim (what the LoRA memory pool calls in both releases; 0.5.23 moved its "
    "config defaults into get_default_hidden_dim): for those two modules use "
    "routed_expert_hidden_size when the config has one",
    upstream=PR_37704 + " item 3",
    remove_when="SGLang LoRA sizes MoE buffers from the experts' own width",
    versions=BOTH,
)

_LATENT_MODULES = ("gate_up_proj_moe", "down_proj_moe")


def latent_moe_hidden_dim(original, module_name, config, *args, **kwargs):
    """AROUND ``lora.utils.get_hidden_dim(module_name, config, base_model, layer_idx, ...)``:
    routed-expert ``(in, out)`` on the latent width of K3; other modules and models unchanged.

    ``gate_up_proj_moe``: ``(routed_expert_hidden_size, 2 * moe_intermediate_size)``;
    ``down_proj_moe``: ``(moe_intermediate_size, routed_expert_hidden_size)``.
    """
    din, dout = original(module_name, config, *args, **kwargs)
    latent = getattr(config, "routed_expert_hidden_size", None)
    if module_name in _LATENT_MODULES and latent:
        if module_name == "gate_up_proj_moe" and din == config.hidden_size:
            din = latent
        elif module_name == "down_proj_moe" and dout == config.hidden_size:
            dout = latent
    return din, dout
