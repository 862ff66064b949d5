"""kimi_core.kernels.bf16_grouped against a float64 recomputation per expert (forward and both gradients)."""

from __future__ import annotations

import pytest
import torch

from kimi_core.kernels.bf16_grouped import bf16_grouped_linear, uses_grouped_mm


@pytest.mark.parametrize("splits", [[5, 0, 11, 0], [0, 0, 16, 3], [1, 1, 1, 1]])
def test_grouped_linear_matches_float64_per_expert(splits):
    g = torch.Generator().manual_seed(sum(splits))
    E, N, K = len(splits), 24, 40
    x = torch.randn(sum(splits), K, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, generator=g) / K**0.5).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), N, generator=g).bfloat16()
    y = bf16_grouped_linear(x, w, splits)
    y.backward(dy)
    assert uses_grouped_mm(x, w) == hasattr(torch, "_grouped_mm")  # the CPU path under test is torch's grouped GEMM
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    rows = torch.repeat_interleave(torch.arange(E), torch.tensor(splits))
    want = torch.einsum("tk,tnk->tn", x64, w64[rows])
    want_dx = torch.einsum("tn,tnk->tk", dy64, w64[rows])
    want_dw = torch.zeros_like(w64).index_add_(0, rows, torch.einsum("tn,tk->tnk", dy64, x64))
    for name, got, ref in (("y", y, want), ("dx", x.grad, want_dx), ("dw", w.grad, want_dw)):
        err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        assert err < 1e-2, f"{name}: relative error {err:.2e} vs the float64 recomputation (splits {splits})"
    assert float(w.grad[[e for e, m in enumerate(splits) if m == 0]].abs().sum()) == 0.0  # empty experts: no grad


def test_grouped_linear_names_the_mismatch():
    with pytest.raises(ValueError, match=r"x \(6, 8\), w \(2, 8, 8\) and m_splits \(2 experts, 5 rows\)"):
        bf16_grouped_linear(torch.zeros(6, 8), torch.zeros(2, 8, 8), [2, 3])
