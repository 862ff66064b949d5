"""The checked-in facts of each supported SGLang release: the live 0.5.23 of this lane matches its rows,
an unpacked 0.5.17 wheel matches its rows (when given), and a difference is named with where it was; the
refusal stand-in of an architecture raises its message at construction."""

from __future__ import annotations

import os

import pytest

from kimi_core.architectures import K3
from kimi_core.errors import PluginError
from kimi_sglang_plugin import host_support
from kimi_sglang_plugin.host_support import FACTS, SUPPORTED_SGLANG, check_release, compare, fn, symbols_for

SRC_0517 = os.environ.get("KIMI_SGLANG_SRC_0517", "")


def test_every_row_is_for_a_supported_release():
    """Rows exist only for the supported releases, and every supported release has rows."""
    for symbol, rows in FACTS.items():
        assert set(rows) <= set(SUPPORTED_SGLANG), f"{symbol}: rows for {sorted(rows)}"
        for release, fact in rows.items():
            assert fact.kind in ("function", "class", "attr", "fields", "absent"), (symbol, release)
            assert bool(fact.where) == (fact.kind != "absent"), f"{symbol}@{release}: where {fact.where!r}"
    assert all(symbols_for(r) for r in SUPPORTED_SGLANG)


def test_live_sglang_matches_its_rows(plugin):
    """The SGLang of this lane (0.5.23; 0.5.17 in the GPU lane) has every recorded symbol with the recorded
    signature, after the hooks are applied too (signatures are read through the wrappers)."""
    release = host_support.sglang_version()
    if release not in SUPPORTED_SGLANG:
        pytest.skip(f"this lane runs SGLang {release}, not a supported release")
    assert check_release(release) == []


def test_difference_is_named(plugin, monkeypatch):
    """A changed signature, a vanished symbol and an unexpected one are each named with the release and
    where that release has it."""
    release = plugin.running_sglang()
    lora_utils = "sglang.srt.lora.utils."
    monkeypatch.setitem(FACTS, lora_utils + "get_hidden_dim", {release: fn("srt/lora/utils.py:146", "module_name")})
    monkeypatch.setitem(FACTS, lora_utils + "no_such_function", {release: fn("srt/lora/utils.py:1")})
    monkeypatch.setitem(FACTS, lora_utils + "get_normalized_target_modules", {release: host_support.ABSENT})
    changed = compare(lora_utils + "get_hidden_dim", release)
    assert "signature" in changed and "sglang/srt/lora/utils.py:146" in changed and release in changed, changed
    assert "missing" in compare(lora_utils + "no_such_function", release)
    assert f"present here, absent in SGLang {release}" in compare(lora_utils + "get_normalized_target_modules", release)
    assert "no recorded facts for SGLang 0.5.9" in compare(lora_utils + "no_such_function", "0.5.9")


@pytest.mark.skipif(
    not SRC_0517, reason="set KIMI_SGLANG_SRC_0517 to an unpacked sglang 0.5.17 wheel to check its rows"
)
def test_0517_rows_match_the_wheel():
    """Every 0.5.17 row equals what the 0.5.17 source has (kind, parameters, file:line), read by ast."""
    from source_facts import source_fact

    wrong = []
    for symbol in symbols_for("0.5.17"):
        want = FACTS[symbol]["0.5.17"]
        got = source_fact(SRC_0517, symbol, want)
        if (got.kind, got.params, got.where) != (want.kind, want.params, want.where):
            wrong.append(f"{symbol}: wheel has {got}, recorded {want}")
    assert not wrong, "\n".join(wrong)


def test_refusal_class_raises_its_message():
    """A refusal stand-in is a torch module class named after the architecture; constructing it, with any
    arguments, raises the one PluginError message it was made with."""
    import torch

    cls = host_support.refusal_class(K3, "kimi_sglang_plugin: SGLang 0.5.20 ...")
    assert cls.__name__ == K3 and issubclass(cls, torch.nn.Module)
    with pytest.raises(PluginError, match=r"SGLang 0\.5\.20"):
        cls(config=None, quant_config=None, prefix="")
