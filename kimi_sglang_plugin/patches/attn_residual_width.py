"""K3 attention residuals at any ``hidden_size``, not only multiples of 1024.

SGLang's Triton score / combine kernels (0.5.17 and 0.5.23 ``layers/attn_residual.py``, ``_BLOCK_H = 1024``,
"H = 7168 = 7 x 1024") run ``hidden_size // 1024`` column blocks with no mask and no remainder. At a width that
is not a multiple of 1024 the combine kernel leaves the remainder of its ``torch.empty`` output unwritten (all
of it below 1024) and the score kernel reads past the row: every aggregation of the attention-residual bank is
then garbage, served without an error (at hidden 512 the served logprobs are uncorrelated with
``kimi_core.reference``). On sm90 every K3 aggregation takes this path (the TMA fast path is
SM100-only and 7168-only). The release (7168) is unaffected; a K3-architecture model of another width is not.

The hook sends exactly those widths to SGLang's own eager mixture, ``aggregate_stream_torch`` (the fallback
its ``aggregate_stream`` already takes for them), and leaves multiples of 1024 on the Triton kernels.
"""

from __future__ import annotations

import logging

from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, HookPatch

#: this patch's ledger row
ENTRY = HookPatch(
    name="attn_residual_width",
    target="sglang.srt.layers.attn_residual._mix_fused",
    host=HOST,
    hook="around",
    fn=f"{__name__}:mix_any_width",
    why="the attention-residual Triton kernels cover hidden_size // 1024 blocks with no mask or remainder "
    "(_BLOCK_H = 1024): at other widths the mixture is left uninitialised and K3 is served wrong "
    "without an error (at hidden 512 the served logprobs are uncorrelated with the reference)",
    how="AROUND: hidden_size % 1024 != 0 returns SGLang's own eager aggregate_stream_torch (what its "
    "aggregate_stream already falls back to for those widths); multiples of 1024 keep the kernels",
    upstream="not filed yet",
    remove_when="_mix_fused masks its column blocks or falls back itself",
    versions=BOTH,
)

logger = logging.getLogger(__name__)
_LOGGED: set[int] = set()


def mix_any_width(original, prefix_sum, bank, nvb, score_proj, score_norm, *args, **kwargs):
    """AROUND ``attn_residual._mix_fused(prefix_sum [T, H], bank [T, R, H], nvb, score_proj, score_norm)`` -> the
    pre-norm mixture ``[T, H]`` (``prefix_sum``'s dtype): SGLang's kernels when ``H % _BLOCK_H == 0``, else its
    eager ``aggregate_stream_torch``."""
    from sglang.srt.layers import attn_residual

    width = prefix_sum.shape[-1]
    if width % attn_residual._BLOCK_H == 0:
        return original(prefix_sum, bank, nvb, score_proj, score_norm, *args, **kwargs)
    if width not in _LOGGED:
        _LOGGED.add(width)
        logger.info(
            "kimi_sglang_plugin: attention residuals at hidden_size %d (not a multiple of %d) run "
            "aggregate_stream_torch",
            width,
            attn_residual._BLOCK_H,
        )
    return attn_residual.aggregate_stream_torch(prefix_sum, bank, nvb, score_proj, score_norm)
