"""The CPU / no-TransformerEngine shims are active exactly when needed, and the version gate is loud."""

from __future__ import annotations

import pytest
import torch


def test_cpu_shims_only_without_gpu():
    """On a machine without CUDA the shim maps torch.cuda.current_device() to 'cpu'; with CUDA it is a no-op."""
    from kimi_megatron_plugin import cpu_compat

    active = cpu_compat.apply_cpu_shims()
    assert active == (not torch.cuda.is_available())
    if active:
        assert torch.cuda.current_device() == "cpu"
        cpu_compat.remove_cpu_shims()
        with pytest.raises(Exception):
            torch.cuda.current_device()
        cpu_compat.apply_cpu_shims()


def test_no_te_shims():
    """Without TransformerEngine, MLA's HAVE_TE is False and moe_utils.te_general_gemm is bound (to None)."""
    pytest.importorskip("megatron.core")
    from kimi_megatron_plugin import cpu_compat
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    cpu_compat.apply_no_te_shims()
    assert hasattr(moe_utils, "te_general_gemm")
    assert not mla.HAVE_TE or isinstance(mla.TELinear, type)


@pytest.mark.parametrize("version,ok", [("0.16.1", True), ("0.19.2", True), ("0.16.0", False), ("0.20.0", False)])
def test_version_gate(version, ok):
    """megatron-core outside [0.16.1, 0.20) raises an error that says what to install."""
    from kimi_megatron_plugin.version import UnsupportedMegatronError, check_mcore_version

    if ok:
        assert str(check_mcore_version(version)) == version
    else:
        with pytest.raises(UnsupportedMegatronError, match="megatron-core==0.16.1"):
            check_mcore_version(version)
