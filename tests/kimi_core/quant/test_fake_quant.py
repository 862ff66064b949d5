"""Fake-quant and fixed-point properties of the two formats."""

from __future__ import annotations

import pytest
import torch

from kimi_core.quant import fake_int4, fake_mxfp4, int4, mxfp4
from kimi_core.quant.verify import check_int4, check_mxfp4


def _w(seed=0, shape=(64, 128)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("convention", ["kimi", "rtn"])
def test_fake_int4_forward_is_the_served_grid(convention):
    """fake_int4 returns exactly dequantize(quantize(w)) and passes the gradient straight through."""
    sd, qmin = int4.CONVENTIONS[convention]
    w = _w().requires_grad_(True)
    y = fake_int4(w, sd, qmin)
    t = int4.quantize(w.detach(), sd, qmin)
    assert torch.equal(y.detach(), int4.dequantize(t["weight_packed"], t["weight_scale"], torch.bfloat16))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(w.grad, g)


def test_fake_mxfp4_forward_is_the_served_grid():
    """fake_mxfp4 returns exactly dequantize(quantize(w)) and passes the gradient straight through."""
    w = _w(1).requires_grad_(True)
    y = fake_mxfp4(w)
    t = mxfp4.quantize(w.detach())
    assert torch.equal(y.detach(), mxfp4.dequantize(t["weight_packed"], t["weight_scale"], torch.bfloat16))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(w.grad, g)


def test_int4_code_range_per_convention():
    """The Kimi convention never emits -8 while RTN uses the full [-8, 7]."""
    w = _w(2, (256, 256))
    qk, _ = int4.quantize_codes(w, 7.0, -7)
    qr, _ = int4.quantize_codes(w, 7.5, -8)
    assert int(qk.min()) == -7 and int(qk.max()) == 7
    assert int(qr.min()) == -8


def test_kimi_int4_is_a_fixed_point_and_rtn_is_not():
    """Re-quantizing a dequantized Kimi-convention tensor gives the same bytes; an RTN one does not."""
    w = _w(3, (128, 256))
    k = int4.quantize(w, 7.0, -7)
    assert check_int4(k["weight_packed"], k["weight_scale"], 7.0, -7).ok
    r = int4.quantize(w, 7.5, -8)
    rep = check_int4(r["weight_packed"], r["weight_scale"], 7.0, -7)
    assert not rep.ok and rep.bad_scales > 0


def test_mxfp4_is_a_fixed_point():
    """Re-quantizing a dequantized MXFP4 tensor reproduces its values and scales."""
    t = mxfp4.quantize(_w(4, (96, 320)))
    assert check_mxfp4(t["weight_packed"], t["weight_scale"]).ok
