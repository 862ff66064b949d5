"""Random 4-bit expert stacks and the float32 oracle shared by the kernel tests."""

from __future__ import annotations

import torch

from kimi_core.quant import dequantize, int4, mxfp4

MXFP4 = mxfp4.FORMAT
INT4 = int4.FORMAT
FORMATS = (MXFP4, INT4)


def random_packed(fmt: str, E: int, N: int, K: int, seed: int = 0, device="cpu", scale_range=(118, 124)):
    """Uniformly random codes (every bit pattern, both signs) and non-zero scales, in the on-disk layout.

    MXFP4 scale bytes are drawn from ``scale_range``; INT4 scales are positive bf16 around 1e-2.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    if fmt == MXFP4:
        wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, **kw)
        ws = torch.randint(scale_range[0], scale_range[1] + 1, (E, N, K // 32), dtype=torch.uint8, **kw)
    else:
        wp = torch.randint(-(2**31), 2**31 - 1, (E, N, K // 8), dtype=torch.int64, **kw).to(torch.int32)
        ws = (torch.rand((E, N, K // 32), **kw) * 0.02 + 0.002).to(torch.bfloat16)
    return wp, ws


def oracle_fwd(x, wp, ws, fmt, splits):
    """``y`` fp32: each expert's rows times its exactly dequantized weight, float32 matmul."""
    y = torch.zeros((x.shape[0], wp.shape[1]), dtype=torch.float32, device=x.device)
    lo = 0
    for e, m in enumerate(int(v) for v in splits):
        if m:
            w = dequantize(fmt, wp[e], ws[e], torch.bfloat16).float()
            y[lo:lo + m] = x[lo:lo + m].float() @ w.t()
        lo += m
    return y


def oracle_dgrad(dy, wp, ws, fmt, splits):
    """``dx`` fp32: each expert's rows of ``dy`` times its exactly dequantized weight."""
    K = ws.shape[-1] * 32
    dx = torch.zeros((dy.shape[0], K), dtype=torch.float32, device=dy.device)
    lo = 0
    for e, m in enumerate(int(v) for v in splits):
        if m:
            w = dequantize(fmt, wp[e], ws[e], torch.bfloat16).float()
            dx[lo:lo + m] = dy[lo:lo + m].float() @ w
        lo += m
    return dx


def ragged_splits(E: int, mean: int, seed: int = 0) -> list[int]:
    """Uneven tokens per expert around ``mean`` with a few empty experts (never all empty)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2 * mean + 1, (E,), generator=g)
    s[torch.randperm(E, generator=g)[: max(1, E // 5)]] = 0
    if s.sum() == 0:
        s[0] = mean + 3
    return [int(v) for v in s]
