"""The cpu_current_device patch is active exactly without CUDA, undoes cleanly, and refuses a changed target."""

from __future__ import annotations

import pytest
import torch

from kimi_core.errors import PatchTargetError


def test_cpu_shims_only_without_gpu():
    """On a machine without CUDA the patch maps torch.cuda.current_device() to 'cpu'; with CUDA it is a no-op."""
    from kimi_megatron_plugin import patches

    active = patches.apply_cpu_shims()
    assert active == (not torch.cuda.is_available())
    if active:
        assert torch.cuda.current_device() == "cpu"
        patches.remove_cpu_shims()
        with pytest.raises(Exception):
            torch.cuda.current_device()
        patches.apply_cpu_shims()


def test_changed_current_device_signature_fails_startup(monkeypatch):
    """If torch.cuda.current_device changes signature, apply_cpu_shims refuses, naming the entry and target."""
    from kimi_megatron_plugin import patches
    from kimi_megatron_plugin.patches import cpu_current_device

    if torch.cuda.is_available():
        pytest.skip("the shim is only applied without CUDA")
    was_active = patches.cpu_shims_active()
    patches.remove_cpu_shims()
    monkeypatch.setattr(cpu_current_device, "ORIGINAL", lambda device=None: 0)
    try:
        with pytest.raises(PatchTargetError, match=r"cpu_current_device.*torch\.cuda\.current_device.*signature"):
            patches.apply_cpu_shims()
        assert not patches.cpu_shims_active()
    finally:
        monkeypatch.undo()
        if was_active:
            patches.apply_cpu_shims()
