"""MoE LoRA on MXFP4 + SiTU: the pieces that run on the CPU (the Marlin kernels need a GPU)."""

from __future__ import annotations

import pytest
import torch

from kimi_core.reference.ops import situ_glu
from kimi_sglang_plugin import moe_lora

from utils import assert_close


@pytest.mark.parametrize("M,N", [(5, 7), (64, 96)], ids=["M5-N7", "M64-N96"])
def test_situ_and_mul_torch_matches_reference(M, N):
    """The torch SiTU-and-mul twin equals kimi_core's SiTU-GLU oracle."""
    x = torch.randn(M, 2 * N) * 4
    ref = situ_glu(x[:, :N].double(), x[:, N:].double(), 4.0, 25.0)
    assert_close("situ_and_mul", ref, moe_lora.situ_and_mul_torch(x.double(), None, 4.0, 25.0), 1e-6)  # fp32 inside, as the kernel
    out = torch.empty(M, N, dtype=torch.bfloat16)
    moe_lora.situ_and_mul_torch(x.bfloat16(), out, 4.0, 25.0)
    assert_close("situ_and_mul bf16", ref, out, 1e-2)


def test_stage2_binding_is_scoped(plugin):
    """The stock Marlin LoRA core's activation is SiTU only inside the call, and restored after errors."""
    import sglang.srt.lora.lora_moe_runner_marlin as stock

    before = stock.__dict__.get("silu_and_mul")
    with pytest.raises(RuntimeError):
        with moe_lora._stage2_as_situ(4.0, 25.0):
            x = torch.randn(3, 8)
            out = torch.empty(3, 4)
            stock.silu_and_mul(x, out)
            assert_close("bound stage 2", situ_glu(x[:, :4], x[:, 4:]), out, 1e-6)
            raise RuntimeError("boom")
    assert stock.__dict__.get("silu_and_mul") is before


def test_runner_core_registered_for_marlin(plugin):
    """MoeRunner's marlin backend builds our core; SiLU configs delegate to the stock core."""
    from sglang.srt.layers.moe.moe_runner import runner
    from sglang.srt.lora.lora_moe_runner_marlin import MarlinLoraRunnerCore

    factory = runner._CUSTOM_RUNNER_CORE_FACTORIES["marlin"]
    core = factory(config=None) if False else factory(None)
    assert type(core).__name__ == "KimiMarlinLoraRunnerCore"
    assert isinstance(core._stock, MarlinLoraRunnerCore)


def test_quant_info_adapter(plugin, monkeypatch):
    """The adapter passes FusedMoEWithLoRA's type gate, serves the MXFP4 Marlin payload, refuses padding."""
    import sglang.srt.layers.quantization.mxfp4_marlin_moe as mm
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsFusedMoEMethod

    inner = type("M", (), {"hidden_pad": 0, "hidden_size": 128, "marker": 7})()
    ad = moe_lora.Mxfp4MarlinQuantInfoAdapter(inner)
    assert isinstance(ad, CompressedTensorsFusedMoEMethod) and ad.marker == 7
    monkeypatch.setattr(mm, "build_marlin_moe_quant_info", lambda layer: ("info", layer))
    assert ad.get_marlin_quant_info("L") == ("info", "L")
    inner.hidden_pad = 64
    with pytest.raises(ValueError, match="padded by 64"):
        ad.get_marlin_quant_info("L")


def test_fused_moe_with_lora_init_hook(plugin, monkeypatch):
    """During the stock constructor the MXFP4 method is presented through the adapter, then restored;
    SiTU's gemm1_alpha no longer implies interleaved gate/up."""
    from types import SimpleNamespace

    method = object()
    monkeypatch.setattr(moe_lora, "_is_mxfp4", lambda m: m is method)
    rc = SimpleNamespace(gemm1_alpha=4.0, gate_up_interleaved=False, activation="situ")
    layer = SimpleNamespace(quant_method=method, moe_runner_config=rc)
    seen = {}

    def original(self, base_layer, backend):
        seen["qm"] = base_layer.quant_method
        self._uses_interleaved_gate_up = True

    wrapper = SimpleNamespace()
    moe_lora.fused_moe_with_lora_init(original, wrapper, layer, None)
    assert type(seen["qm"]).__name__ == "Mxfp4MarlinQuantInfoAdapter"
    assert layer.quant_method is method and wrapper.quant_method is method
    assert wrapper._uses_interleaved_gate_up is False
