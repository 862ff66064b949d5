"""Megatron's patch ledger: every entry matches the installed hosts, and a changed target fails the startup check."""

from __future__ import annotations

import pytest
import torch

from kimi_core.errors import KimiError, PatchTargetError


@pytest.mark.parametrize("name", ["cpu_current_device", "mla_have_te", "router_te_general_gemm"])
def test_every_ledger_entry_matches_installed_host(name):
    """Each recorded target resolves and looks as the ledger says on the installed megatron-core and torch."""
    from kimi_megatron_plugin import cpu_compat, patches

    entry = patches.LEDGER[name]
    assert entry.why and entry.how and entry.upstream and entry.remove_when and entry.releases
    patches.check(name, target_obj=cpu_compat._ORIGINAL_CURRENT_DEVICE if name == "cpu_current_device" else None)


def test_changed_current_device_signature_fails_startup(monkeypatch):
    """If torch.cuda.current_device changes signature, apply_cpu_shims refuses, naming the entry and target."""
    from kimi_megatron_plugin import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the shim is only applied without CUDA")
    was_active = cpu_compat.cpu_shims_active()
    cpu_compat.remove_cpu_shims()
    monkeypatch.setattr(cpu_compat, "_ORIGINAL_CURRENT_DEVICE", lambda device=None: 0)
    try:
        with pytest.raises(PatchTargetError, match=r"cpu_current_device.*torch\.cuda\.current_device.*signature"):
            cpu_compat.apply_cpu_shims()
        assert not cpu_compat.cpu_shims_active()
    finally:
        monkeypatch.undo()
        if was_active:
            cpu_compat.apply_cpu_shims()


def test_router_no_longer_reading_the_name_fails(monkeypatch):
    """If megatron's router stops reading te_general_gemm (upstream fixed it), the no-TE shim check says so."""
    from megatron.core.transformer.moe import moe_utils

    from kimi_megatron_plugin import cpu_compat

    monkeypatch.setattr(moe_utils.RouterGatingLinearFunction, "forward", staticmethod(lambda ctx, x: x))
    with pytest.raises(PatchTargetError, match="router_te_general_gemm.*te_general_gemm"):
        cpu_compat.apply_no_te_shims()


def test_release_outside_ledger_fails():
    """A megatron-core release outside the entry's checked releases is refused; the error is a KimiError."""
    from kimi_core.patch_ledger import check_patch
    from kimi_megatron_plugin import patches

    with pytest.raises(KimiError, match="megatron-core 0.21.0 is outside"):
        check_patch(patches.LEDGER["mla_have_te"], "0.21.0")
