"""MoE LoRA on MXFP4 + SiTU: the pieces that run on the CPU (the Marlin kernels need a GPU)."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

from kimi_core.reference.ops import situ_glu
from kimi_sglang_plugin import moe_lora
from kimi_sglang_plugin.patches import moe_lora_marlin


@pytest.mark.parametrize("M,N", [(5, 7), (64, 96)], ids=["M5-N7", "M64-N96"])
def test_situ_and_mul_torch_matches_reference(M, N):
    """The torch SiTU-and-mul twin equals kimi_core's SiTU-GLU oracle."""
    x = torch.randn(M, 2 * N) * 4
    ref = situ_glu(x[:, :N].double(), x[:, N:].double(), 4.0, 25.0)
    assert_close(
        "situ_and_mul", ref, moe_lora.situ_and_mul_torch(x.double(), None, 4.0, 25.0), 1e-6
    )  # fp32 inside, as the kernel
    out = torch.empty(M, N, dtype=torch.bfloat16)
    moe_lora.situ_and_mul_torch(x.bfloat16(), out, 4.0, 25.0)
    assert_close("situ_and_mul bf16", ref, out, 1e-2)


def test_stage2_binding_is_scoped(plugin):
    """The stock Marlin LoRA core's activation is SiTU only inside the call, and restored after errors."""
    import sglang.srt.lora.lora_moe_runner_marlin as stock

    before = stock.__dict__.get("silu_and_mul")
    with pytest.raises(RuntimeError):
        with moe_lora.situ_activation_stage(4.0, 25.0):
            x = torch.randn(3, 8)
            out = torch.empty(3, 4)
            stock.silu_and_mul(x, out)
            assert_close("bound stage 2", situ_glu(x[:, :4], x[:, 4:]), out, 1e-6)
            raise RuntimeError("boom")
    assert stock.__dict__.get("silu_and_mul") is before


def test_situ_stage_hook(plugin):
    """SiLU layers reach the stock core unchanged; a SiTU layer reaches it presented as SiLU with its
    activation stage computing SiTU during the call only; a SiTU layer without its betas is named."""
    import sglang.srt.lora.lora_moe_runner_marlin as stock
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    before = stock.__dict__.get("silu_and_mul")  # absent on the CPU (imported only with CUDA)
    seen = []

    def original(core, dispatch_output, quant_info, runner_config, hooks=None):
        x, out = torch.randn(3, 8), torch.empty(3, 4)
        stage = stock.__dict__.get("silu_and_mul")
        if stage is not before:  # bound for this call: run it as the stock core would
            stage(x, out)
        seen.append((runner_config, hooks, x, out))
        return "combined"

    silu = MoeRunnerConfig(activation="silu")
    assert moe_lora_marlin.marlin_lora_run_from_dispatch(original, None, "d", "q", silu, hooks="h") == "combined"
    assert seen[-1][0] is silu and seen[-1][1] == "h"
    situ = MoeRunnerConfig(activation="situ", gemm1_alpha=4.0, gemm1_clamp_limit=25.0, gate_up_interleaved=False)
    moe_lora_marlin.marlin_lora_run_from_dispatch(original, None, "d", "q", situ, hooks="h")
    rc, _, x, out = seen[-1]
    assert rc.activation == "silu" and rc.gemm1_alpha == 4.0 and situ.activation == "situ"
    assert_close("SiTU stage", situ_glu(x[:, :4], x[:, 4:], 4.0, 25.0), out, 1e-6)
    assert stock.__dict__.get("silu_and_mul") is before
    with pytest.raises(ValueError, match="activation_situ_beta"):
        moe_lora_marlin.marlin_lora_run_from_dispatch(original, None, "d", "q", MoeRunnerConfig(activation="situ"))


def test_cuda_graph_buffers_see_marlin_shapes():
    """0.5.17's buffer setup gets w13_weight [E, 2I, K] / w2_weight [E, K, I] from the layer's own sizes when
    the quant info is Marlin's; other quant infos pass through; other attributes stay the layer's."""
    from types import SimpleNamespace

    base = SimpleNamespace(
        num_local_experts=16, intermediate_size_per_partition=128, hidden_size=256, top_k=4, num_experts=16
    )
    marlin = SimpleNamespace(
        base_layer=base, _quant_info=SimpleNamespace(w13_qweight=torch.empty(16, 16, 64)), marker=7
    )
    got = []

    def original(backend, max_bs, max_loras, dtype, layer, *a, **k):
        got.append(layer)

    moe_lora_marlin.init_cuda_graph_moe_buffers(original, None, 8, 2, torch.bfloat16, marlin)
    view = got[-1]
    assert tuple(view._quant_info.w13_weight.shape) == (16, 256, 256)
    assert tuple(view._quant_info.w2_weight.shape) == (16, 256, 128)
    assert view._quant_info.w13_weight.device == torch.device("cpu")
    assert view.base_layer is base and view.marker == 7
    triton = SimpleNamespace(base_layer=base, _quant_info=SimpleNamespace(w13_weight=torch.empty(1)))
    moe_lora_marlin.init_cuda_graph_moe_buffers(original, None, 8, 2, torch.bfloat16, triton)
    assert got[-1] is triton


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
    with pytest.raises(ValueError, match="hidden width is padded by 64.*multiple of 256"):
        ad.get_marlin_quant_info("L")
    inner.hidden_pad, inner.intermediate_pad = 0, 64
    with pytest.raises(ValueError, match="intermediate width is padded by 64.*multiple of 128"):
        ad.get_marlin_quant_info("L")


def test_fused_moe_with_lora_init_hook(plugin, monkeypatch):
    """During the stock constructor the MXFP4 method is presented through the adapter, then restored;
    SiTU's gemm1_alpha no longer implies interleaved gate/up."""
    from types import SimpleNamespace

    method = object()
    monkeypatch.setattr(moe_lora_marlin, "is_mxfp4_method", lambda m: m is method)
    rc = SimpleNamespace(gemm1_alpha=4.0, gate_up_interleaved=False, activation="situ")
    layer = SimpleNamespace(quant_method=method, moe_runner_config=rc)
    seen = {}

    def original(self, base_layer, backend):
        seen["qm"] = base_layer.quant_method
        self._uses_interleaved_gate_up = True

    wrapper = SimpleNamespace()
    moe_lora_marlin.fused_moe_with_lora_init(original, wrapper, layer, None)
    assert type(seen["qm"]).__name__ == "Mxfp4MarlinQuantInfoAdapter"
    assert layer.quant_method is method and wrapper.quant_method is method
    assert wrapper._uses_interleaved_gate_up is False
