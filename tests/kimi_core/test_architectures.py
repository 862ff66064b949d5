"""Architecture names of kimi_core.architectures against the published configs and transformers' own classes."""

from __future__ import annotations

import transformers

from kimi_core import architectures as A
from kimi_core.config import KimiConfig
from kimi_core.release_configs import k2_release_config, k3_release_config, k31_release_config


def test_k2_is_transformers_deepseek_v3_class():
    """K2.x is served as transformers' DeepseekV3ForCausalLM: the name must be that class's name."""
    assert A.K2 == transformers.DeepseekV3ForCausalLM.__name__


def test_release_configs_name_their_family():
    """Each published config's architectures[0] maps back to its family, and load_config agrees."""
    for family, cfg in (("k2", k2_release_config()), ("k3", k3_release_config()), ("k31", k31_release_config())):
        arch = cfg["architectures"][0]
        assert A.FAMILIES[family] == arch
        assert A.family_of(arch) == family
        assert KimiConfig.from_hf(cfg, where=family).family == family


def test_aliases_and_unknown_names():
    """The K2 alias and the K3 text class map to their families; a non-Kimi class maps to None."""
    assert A.family_of(A.K2_ALIAS) == "k2" and A.family_of(A.K3_LINEAR) == "k3"
    assert A.family_of("LlamaForCausalLM") is None
    assert len(set(A.ALL_ARCHITECTURES)) == len(A.ALL_ARCHITECTURES)
