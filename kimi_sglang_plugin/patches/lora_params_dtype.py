"""sgl-project/sglang#37704 item 4 (SGLang 0.5.23): a LoRA wrapper shows its base layer's ``params_dtype``.

``KimiK3LinearForCausalLM.post_load_weights`` reads ``self_attn.o_proj.params_dtype`` to precompile the KDA
kernel; through a LoRA wrapper it is ``None`` and falls back to the (possibly quantized) weight dtype on every
RL reload. The wrapper already mirrors ``weight`` / ``bias``; this mirrors ``params_dtype`` too. 0.5.17 reads
``o_proj.weight.dtype`` there and does not need it.
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.hook_patch import HOST, ONLY_0523, PR_37704, HookPatch

__all__ = ["ENTRY", "mirror_params_dtype"]

#: this patch's ledger row
ENTRY = HookPatch(
    name="lora_params_dtype",
    target="sglang.srt.lora.layers.BaseLayerWithLoRA.__init__",
    host=HOST,
    hook="after",
    fn=f"{__name__}:mirror_params_dtype",
    why="KimiK3LinearForCausalLM.post_load_weights reads self_attn.o_proj.params_dtype to "
    "precompile the KDA kernel; through a LoRA wrapper it is None and falls back to the "
    "(possibly quantized) weight dtype on every RL reload",
    how="AFTER: mirror base_layer.params_dtype onto the wrapper, as it already mirrors weight/bias",
    upstream=PR_37704 + " item 4",
    remove_when="BaseLayerWithLoRA forwards params_dtype upstream",
    versions=ONLY_0523,
    absent_in="0.5.17: post_load_weights reads o_proj.weight.dtype (models/kimi_k3.py:2926), which the wrapper mirrors",
)


def mirror_params_dtype(result, wrapper, base_layer, *args, **kwargs):
    """After ``BaseLayerWithLoRA.__init__``: ``wrapper.params_dtype = base_layer.params_dtype``."""
    dt = getattr(base_layer, "params_dtype", None)
    if dt is not None and "params_dtype" not in wrapper.__dict__:
        object.__setattr__(wrapper, "params_dtype", dt)
    return None
