"""The no-TransformerEngine patches (mla_have_te, router_te_general_gemm) leave megatron-core consistent without TE,
and refuse a target that upstream has fixed."""

from __future__ import annotations

import pytest

from kimi_core.errors import PatchTargetError


def test_no_te_shims():
    """Without TransformerEngine, MLA's HAVE_TE is False and moe_utils.te_general_gemm is bound (to None)."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    from kimi_megatron_plugin import patches

    patches.apply_no_te_shims()
    assert hasattr(moe_utils, "te_general_gemm")
    assert not mla.HAVE_TE or isinstance(mla.TELinear, type)


def test_router_no_longer_reading_the_name_fails(monkeypatch):
    """If megatron's router stops reading te_general_gemm (upstream fixed it), the no-TE patch check says so."""
    from megatron.core.transformer.moe import moe_utils

    from kimi_megatron_plugin import patches

    monkeypatch.setattr(moe_utils.RouterGatingLinearFunction, "forward", staticmethod(lambda ctx, x: x))
    with pytest.raises(PatchTargetError, match="router_te_general_gemm.*te_general_gemm"):
        patches.apply_no_te_shims()


def test_mla_flag_no_longer_a_bool_fails(monkeypatch):
    """If megatron-core's MLA stops keeping HAVE_TE as a bool, the mla_have_te check refuses, naming the row."""
    from megatron.core.transformer import multi_latent_attention as mla

    from kimi_megatron_plugin.patches import mla_have_te

    monkeypatch.setattr(mla, "HAVE_TE", None)
    with pytest.raises(PatchTargetError, match="mla_have_te.*NoneType"):
        mla_have_te.apply()
