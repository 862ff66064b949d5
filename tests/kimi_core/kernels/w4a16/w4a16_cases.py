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


def oracle_blocks(op: str, a, wp, ws, fmt, splits):
    """Per non-empty expert ``(first row, rows, fp32 reference rows)``: its rows of ``a`` times its exactly
    dequantized weight in float32, ``x . W^T`` (``op`` ``"fwd"``, ``a`` = ``x [T, K]``) or ``dy . W`` (``"dgrad"``,
    ``a`` = ``dy [T, N]``)."""
    lo = 0
    for e, m in enumerate(int(v) for v in splits):
        if m:
            w = dequantize(fmt, wp[e], ws[e], torch.bfloat16).float()
            yield lo, m, a[lo : lo + m].float() @ (w.t() if op == "fwd" else w)
        lo += m


def _oracle(op: str, a, wp, ws, fmt, splits, out_cols: int):
    out = torch.zeros((a.shape[0], out_cols), dtype=torch.float32, device=a.device)
    for lo, m, ref in oracle_blocks(op, a, wp, ws, fmt, splits):
        out[lo : lo + m] = ref
    return out


def oracle_fwd(x, wp, ws, fmt, splits):
    """``y`` fp32: each expert's rows times its exactly dequantized weight, float32 matmul."""
    return _oracle("fwd", x, wp, ws, fmt, splits, wp.shape[1])


def oracle_dgrad(dy, wp, ws, fmt, splits):
    """``dx`` fp32: each expert's rows of ``dy`` times its exactly dequantized weight."""
    return _oracle("dgrad", dy, wp, ws, fmt, splits, ws.shape[-1] * 32)


def assert_close_streamed(name: str, op: str, a, wp, ws, fmt, splits, got, ratio: float) -> float:
    """:func:`oracle_fwd` (``op`` ``"fwd"``, ``a`` = ``x``) or :func:`oracle_dgrad` (``"dgrad"``, ``a`` = ``dy``)
    compared with ``got`` one expert at a time (:func:`oracle_blocks`): the relative RMS error over all rows,
    accumulated in float64, at most ``ratio``. For real-width layers at thousands of tokens per expert, whose whole
    fp32 oracle and its float64 comparison (~14 GiB each for K2 fc2's 240 k x 7168 output) would not fit next to
    the operands on an 80 GB card."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values in result"
    rows = sum(int(v) for v in splits)
    assert got.shape[0] == rows, f"{name}: {got.shape[0]} rows, the splits sum to {rows}"
    err2 = ref2 = max_abs = 0.0
    for lo, m, ref in oracle_blocks(op, a, wp, ws, fmt, splits):
        diff = got[lo : lo + m].double() - ref.double()
        err2 += diff.pow(2).sum().item()
        ref2 += ref.double().pow(2).sum().item()
        max_abs = max(max_abs, diff.abs().max().item())
    err = (err2 / ref2) ** 0.5 if ref2 > 0 else err2**0.5
    print(f"{name}: rel_rms={err:.3e} max_abs={max_abs:.3e} (tol {ratio:.1e})")
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs diff {max_abs:.3e})"
    return err


def ragged_splits(E: int, mean: int, seed: int = 0) -> list[int]:
    """Uneven tokens per expert around ``mean`` with a few empty experts (never all empty)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2 * mean + 1, (E,), generator=g)
    s[torch.randperm(E, generator=g)[: max(1, E // 5)]] = 0
    if s.sum() == 0:
        s[0] = mean + 3
    return [int(v) for v in s]
