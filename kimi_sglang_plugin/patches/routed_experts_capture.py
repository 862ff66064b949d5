"""K3 routed-experts capture (``--enable-return-routed-experts``, what miles' rollout routing replay reads) on
SGLang 0.5.17.

0.5.17 cannot return routed experts for the in-tree K3 at all (stock, and through the plugin without these hooks):

* ``RoutedExpertsCapturer.__init__`` (``srt/state_capturer/routed_experts.py:69``) reads
  ``hf_text_config.num_experts_per_tok``; K3's ``KimiLinearConfig`` names it ``num_experts_per_token`` and has no
  alias, so the memory pool init raises ``AttributeError`` and the scheduler exits;
* ``KimiK3MoE`` builds its ``TopK`` without ``layer_id`` (``srt/models/kimi_k3.py:424``), so the capture writes
  ``buffer[:T, None, :] = topk_ids`` and the first prefill raises "The expanded size of the tensor (5) must match
  the existing size (19)".

0.5.23 fixed both (``KimiLinearConfig.attribute_map`` maps the DeepSeek name; ``TopK(layer_id=self.layer_idx)``),
so these hooks apply to 0.5.17 only.
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.config_alias import alias_field
from kimi_sglang_plugin.patches.hook_patch import HOST, ONLY_0517, HookPatch

#: this file's ledger rows, in the order they are registered
ENTRIES: tuple[HookPatch, ...] = (
    HookPatch(
        name="routed_experts_capture.top_k_name",
        target="sglang.srt.configs.kimi_linear.KimiLinearConfig.__init__",
        host=HOST,
        hook="after",
        fn=f"{__name__}:alias_num_experts_per_tok",
        why="RoutedExpertsCapturer reads hf_text_config.num_experts_per_tok, which K3's KimiLinearConfig calls "
        "num_experts_per_token: with --enable-return-routed-experts the scheduler dies at memory pool init "
        "(stock K3 too)",
        how="AFTER: set config.num_experts_per_tok = config.num_experts_per_token",
        upstream="fixed in 0.5.23 (KimiLinearConfig.attribute_map)",
        remove_when="0.5.17 leaves the supported releases",
        versions=ONLY_0517,
        absent_in="0.5.23: KimiLinearConfig.attribute_map maps num_experts_per_tok (configs/kimi_linear.py:13)",
    ),
    HookPatch(
        name="routed_experts_capture.topk_layer_id",
        target="sglang.srt.models.kimi_k3.KimiK3MoE.__init__",
        host=HOST,
        hook="after",
        fn=f"{__name__}:topk_layer_id",
        why="KimiK3MoE builds TopK without layer_id, so the routed-experts capture indexes its buffer with None "
        "and the first prefill raises a shape error (stock K3 too)",
        how="AFTER: moe.topk.layer_id = moe.layer_idx when it is None",
        upstream="fixed in 0.5.23 (TopK(layer_id=self.layer_idx), models/kimi_k3.py:524)",
        remove_when="0.5.17 leaves the supported releases",
        versions=ONLY_0517,
        absent_in="0.5.23: KimiK3MoE passes layer_id=self.layer_idx to TopK (models/kimi_k3.py:526)",
    ),
)


def alias_num_experts_per_tok(result, config, *args, **kwargs):
    """After ``KimiLinearConfig.__init__``: ``config.num_experts_per_tok`` = ``config.num_experts_per_token``
    (int), the name SGLang's routed-experts capturer reads."""
    alias_field(config, "num_experts_per_token", "num_experts_per_tok")
    return None


def topk_layer_id(result, moe, *args, **kwargs):
    """After ``KimiK3MoE.__init__``: its ``TopK`` gets the layer index (``moe.layer_idx``, int) the capturer
    writes routed experts under, as the experts already have."""
    if getattr(moe.topk, "layer_id", None) is None:
        moe.topk.layer_id = moe.layer_idx
    return None
