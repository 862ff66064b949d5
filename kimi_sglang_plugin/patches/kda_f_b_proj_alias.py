"""sgl-project/sglang#37704 item 5 (SGLang 0.5.23): KDA's ``f_b_proj.weight`` keeps its parameter name.

``KimiK3DeltaAttention._merge_bfa_weights`` does ``self._bfa_f_b_w = self.f_b_proj.weight``, which registers
the Parameter a second time: ``named_parameters()`` then yields it as ``self_attn._bfa_f_b_w`` before
``self_attn.f_b_proj.weight``, whose name disappears from ``params_dict``, so RL weight reloads skip
``f_b_proj`` silently, and the second ``post_load_weights`` raises "attribute already exists". The hook keeps
``_bfa_f_b_w`` a plain, unregistered alias. 0.5.17 merges only ``f_a_proj`` + ``b_proj`` into a plain tensor.
"""

from __future__ import annotations

from kimi_sglang_plugin.patches.hook_patch import HOST, ONLY_0523, PR_37704, HookPatch

__all__ = ["ENTRY", "merge_bfa_weights_once"]

#: this patch's ledger row
ENTRY = HookPatch(
    name="kda_f_b_proj_alias",
    target="sglang.srt.models.kimi_k3.KimiK3DeltaAttention._merge_bfa_weights",
    host=HOST,
    hook="around",
    fn=f"{__name__}:merge_bfa_weights_once",
    why="`self._bfa_f_b_w = self.f_b_proj.weight` registers the Parameter a second time; "
    "named_parameters() then yields it as self_attn._bfa_f_b_w before self_attn.f_b_proj.weight, "
    "whose name disappears from params_dict, so RL weight reloads skip f_b_proj silently, and "
    "the second post_load_weights raises 'attribute already exists'",
    how="AROUND: drop the previous plain attribute, run the original, then move _bfa_f_b_w out of "
    "_parameters into a plain (unregistered) attribute",
    upstream=PR_37704 + " item 5",
    remove_when="_merge_bfa_weights stores the alias without registering it",
    versions=ONLY_0523,
    absent_in="0.5.17: _merge_bfa_weights (models/kimi_k3.py:1525) merges only f_a_proj + b_proj into "
    "a plain tensor and never aliases f_b_proj",
)

_ALIASES = ("_bfa_f_b_w",)


def merge_bfa_weights_once(original, attn, *args, **kwargs):
    """AROUND ``KimiK3DeltaAttention._merge_bfa_weights``: keep ``_bfa_f_b_w`` an unregistered alias."""
    for name in _ALIASES:
        attn.__dict__.pop(name, None)  # a previous run's plain alias blocks register_parameter
        attn._parameters.pop(name, None)
    out = original(attn, *args, **kwargs)
    for name in _ALIASES:
        p = attn._parameters.pop(name, None)
        if p is not None:
            object.__setattr__(attn, name, p)
    return out
