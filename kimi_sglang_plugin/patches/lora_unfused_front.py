"""K3 with LoRA: keep the shared experts out of SGLang's merged MoE front, so their LoRA is applied.

After loading, ``KimiK3MoE._merge_front_weights`` (``srt/models/kimi_k3.py``: 0.5.17 line 593, 0.5.23 line 711)
concatenates the bf16 weights of ``shared_experts.gate_up_proj``, the router ``gate`` and
``routed_expert_down_proj`` into one ``[gu + E + latent, H]`` buffer, and ``_forward_fused`` then multiplies the
hidden states by that buffer and the shared experts' activations by ``shared_experts.down_proj.weight``
directly. SGLang's LoRA wraps those modules *after* the merge, and the fused path never calls them: shared-expert
LoRA is accepted, loaded and silently not applied (a shared gate/up/down adapter is served far outside the
bf16 floor, while routed-expert and attention adapters in the same engine are within it). 0.5.23 merges the
same way.

Fix: when LoRA is enabled on the server (``--enable-lora`` or ``--lora-paths``) the merge is skipped, so
``_front_w`` stays ``None`` and every forward takes ``_forward_unfused``, which calls the (LoRA-wrapped) modules.
Without LoRA nothing changes. When the server arguments cannot be read the merge is skipped too: the unfused
path is always correct, only the fused one can drop an adapter.
"""

from __future__ import annotations

import logging

from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, HookPatch

#: this patch's ledger row
ENTRY = HookPatch(
    name="lora_unfused_front",
    target="sglang.srt.models.kimi_k3.KimiK3MoE._merge_front_weights",
    host=HOST,
    hook="around",
    fn=f"{__name__}:merge_front_weights_unless_lora",
    why="the merged MoE front multiplies by one buffer holding shared_experts.gate_up_proj, gate and "
    "routed_expert_down_proj, and the shared down GEMM reads down_proj.weight directly; LoRA wraps those "
    "modules after the merge, so shared-expert LoRA is loaded and silently not applied (served logprobs "
    "far outside the bf16 floor)",
    how="AROUND: skip the merge when the server has LoRA on (or its arguments cannot be read), so every "
    "forward takes _forward_unfused, which calls the LoRA-wrapped modules",
    upstream="none (0.5.17 and 0.5.23 both merge)",
    remove_when="SGLang skips or LoRA-aware-fuses the K3 MoE front when LoRA is enabled",
    versions=BOTH,
)

log = logging.getLogger(__name__)
_logged = False


def server_lora_enabled() -> bool:
    """True when the running SGLang server has LoRA on (``enable_lora``, or ``lora_paths`` with
    ``enable_lora`` unset, as SGLang itself decides), or when its arguments cannot be read."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        return bool(args.enable_lora) or (args.enable_lora is None and bool(args.lora_paths))
    except Exception as e:  # noqa: BLE001 - not published yet / another layout: be correct rather than fast
        log.warning("kimi_sglang_plugin: cannot read SGLang's server arguments (%s); K3's MoE front stays unmerged", e)
        return True


def merge_front_weights_unless_lora(original, moe, *args, **kwargs):
    """AROUND ``KimiK3MoE._merge_front_weights``: run it only when LoRA is off (logged once per process)."""
    global _logged
    if server_lora_enabled():
        if not _logged:
            log.info(
                "kimi_sglang_plugin: LoRA on, K3 MoE layers keep their front unmerged (shared-expert LoRA applies)"
            )
            _logged = True
        return None
    return original(moe, *args, **kwargs)
