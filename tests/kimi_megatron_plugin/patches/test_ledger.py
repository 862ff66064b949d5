"""Megatron's patch ledger: every row matches the installed hosts, and a host outside a row's releases is refused."""

from __future__ import annotations

import pytest

from kimi_core.errors import KimiError, PatchTargetError

MCORE_ROWS = ["cpu_current_device", "mla_have_te", "router_te_general_gemm"]


def test_every_row_is_complete_and_named_as_its_file():
    """Each row says why, how, upstream, when to remove it and the host releases, and lives in the patch file of its name as ENTRY."""
    import importlib

    from kimi_megatron_plugin import patches

    assert sorted(patches.LEDGER) == sorted([*MCORE_ROWS, "te_stub"])
    for name, entry in patches.LEDGER.items():
        assert entry.name == name
        assert entry.why and entry.how and entry.upstream and entry.remove_when and entry.versions
        assert importlib.import_module(f"kimi_megatron_plugin.patches.{name}").ENTRY is entry


@pytest.mark.parametrize("name", MCORE_ROWS)
def test_every_megatron_core_row_matches_installed_host(name):
    """Each recorded megatron-core target resolves and looks as the ledger says on the installed megatron-core
    and torch."""
    from kimi_megatron_plugin import patches
    from kimi_megatron_plugin.patches import cpu_current_device

    patches.check(name, target_obj=cpu_current_device.ORIGINAL if name == "cpu_current_device" else None)


def test_rows_use_the_supported_host_ranges():
    """The megatron-core rows are recorded against host_support's range, te_stub against megatron-bridge's."""
    from kimi_megatron_plugin import patches
    from kimi_megatron_plugin.host_support import MEGATRON_BRIDGE, MEGATRON_CORE

    for name in MCORE_ROWS:
        assert (patches.LEDGER[name].host, patches.LEDGER[name].versions) == (
            "megatron-core",
            MEGATRON_CORE.ledger_releases,
        )
    te = patches.LEDGER["te_stub"]
    assert (te.host, te.versions) == ("megatron-bridge", MEGATRON_BRIDGE.releases)


def test_release_outside_ledger_fails():
    """A megatron-core release outside the entry's checked releases is refused; the error is a KimiError."""
    from kimi_core.patch_ledger import check_patch
    from kimi_megatron_plugin import patches

    with pytest.raises(KimiError, match="megatron-core 0.21.0 is outside"):
        check_patch(patches.LEDGER["mla_have_te"], "0.21.0")


def test_check_names_the_row(monkeypatch):
    """patches.check reads the installed host release: a release outside the row fails naming the row."""
    from kimi_megatron_plugin import patches

    monkeypatch.setattr(patches, "host_release", lambda distribution: "0.20.0")
    with pytest.raises(PatchTargetError, match="'mla_have_te'.*0.20.0"):
        patches.check("mla_have_te")
