"""GPU fake quantization: bit-exact with kimi_core.quant's CPU path, straight-through backward."""

from __future__ import annotations

import pytest
import torch

from kimi_core.kernels import fake_int4_gpu, fake_mxfp4_gpu, fake_quant_gpu
from kimi_core.quant import fake_int4, fake_mxfp4


def _weights(shape, dtype, seed=0):
    """Random weights with awkward groups: an all-zero group, exact ties, huge and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.03
    flat = w.view(-1, 32)
    flat[0] = 0.0
    flat[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * 2.0**-3
    flat[2] *= 1e4
    flat[3] *= 1e-30
    flat[4, :16] = -0.0
    return w.to(dtype)


def test_cpu_dispatch_is_the_reference():
    """On CPU the dispatchers are kimi_core.quant's straight-through fake quant."""
    w = _weights((4, 64), torch.bfloat16).requires_grad_()
    assert torch.equal(fake_quant_gpu(w, "mxfp4-pack-quantized"), fake_mxfp4(w))
    assert torch.equal(fake_quant_gpu(w, "pack-quantized", 7.5, -8), fake_int4(w, 7.5, -8))
    fake_mxfp4_gpu(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("conv", [(7.0, -7), (7.5, -8)], ids=["kimi", "rtn"])
def test_fake_int4_gpu_bit_exact(dtype, conv):
    """Triton fake-INT4 equals kimi_core.quant.fake_int4 bit for bit, both conventions."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w = _weights((8, 96, 320), dtype, seed=1)
    ref = fake_int4(w, *conv)
    got = fake_int4_gpu(w.cuda(), *conv).cpu()
    assert got.dtype == ref.dtype
    assert torch.equal(
        got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fake_mxfp4_gpu_bit_exact(dtype):
    """Triton fake-MXFP4 equals kimi_core.quant.fake_mxfp4 bit for bit (signed zeros included)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w = _weights((8, 96, 320), dtype, seed=2)
    ref = fake_mxfp4(w)
    got = fake_mxfp4_gpu(w.cuda()).cpu()
    assert got.dtype == ref.dtype
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    bad = (got.view(iv) != ref.view(iv)).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        grp = w[i[:-1]].view(-1, 32)[i[-1] // 32]
        print(
            "mismatches",
            len(bad),
            "first",
            i,
            "got",
            got[i].item(),
            "ref",
            ref[i].item(),
            "w",
            w[i].item(),
            "group",
            grp.tolist(),
        )
    assert len(bad) == 0


@pytest.mark.gpu
def test_fake_quant_gpu_straight_through():
    """The GPU fake quants pass the gradient to the master unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w = _weights((4, 128), torch.bfloat16).cuda().requires_grad_()
    g = torch.randn_like(w)
    (fake_int4_gpu(w) * g).sum().backward()
    assert torch.equal(w.grad, g)
    w.grad = None
    (fake_quant_gpu(w, "mxfp4-pack-quantized") * g).sum().backward()
    assert torch.equal(w.grad, g)
