"""The fused Triton W4A16 backend (:mod:`kimi_core.kernels.w4a16.fused`) on the CPU: its kernels in Triton's
interpreter against a float32 oracle, and its launch plans (:mod:`.fused.plans`) as data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kimi_core.kernels import MXFP4_FORMAT

_INTERP_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, sys.argv[1])
from w4a16_cases import oracle_fwd, oracle_dgrad, random_packed
from kimi_core.kernels.w4a16.fused import launch as tw
from kimi_core.kernels.w4a16.fused.plans import tail_pieces
from kimi_core.kernels.w4a16.format_ids import FMT_MXFP4, FMT_MXFP4_FOLDED, kernel_format_id
worst = 0.0
for fmt in ("mxfp4-pack-quantized", "pack-quantized"):
    E, N, K, splits = 3, 64, 256, [5, 0, 20]
    wp, ws = random_packed(fmt, E, N, K, seed=3)
    x = torch.randn(25, K).bfloat16()
    dy = torch.randn(25, N).bfloat16()
    ref_y = oracle_fwd(x, wp, ws, fmt, splits)
    ref_dx = oracle_dgrad(dy, wp, ws, fmt, splits)
    for perm in (True, False):
        base = dict(BLOCK_M=16, num_warps=4, num_stages=1, PERM=perm)
        y = tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(base, BLOCK_N=64, **({} if perm else {"BLOCK_K": 64})))
        dgrad_cfg = dict(base, BLOCK_N=32, **({} if perm else {"BLOCK_K": 64}))
        dx = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=dgrad_cfg)
        for ref, got in ((ref_y, y), (ref_dx, dx)):
            worst = max(worst, ((got.float() - ref).norm() / ref.norm()).item())
    # the permuted dgrad with its reduction over N split: 3 BLOCK_N steps in 2 (uneven), 3 and 4 (clamped) ranges
    wp3, ws3 = random_packed(fmt, E, 96, K, seed=4)
    dy3 = torch.randn(25, 96).bfloat16()
    ref3 = oracle_dgrad(dy3, wp3, ws3, fmt, splits)
    for split in (2, 3, 4):
        dx3 = tw.grouped_gemm_dgrad(dy3, wp3, ws3, fmt, splits,
                                    config=dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, SPLIT_N=split))
        err = ((dx3.float() - ref3).norm() / ref3.norm()).item()
        assert err < 1e-2, (fmt, split, err)
        worst = max(worst, err)
    # the persistent forward (2 programs walking every tile in one flattened loop nest): the same tiles, the same
    # results bit for bit, ragged and empty experts included
    cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    one_per_tile = tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(cfg))
    walking = tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(cfg, PERSISTENT=2))
    assert torch.equal(one_per_tile, walking), fmt
    worst = max(worst, ((walking.float() - ref_y).norm() / ref_y.norm()).item())
    # the weights loaded as runs along each row (forward and dgrad; walking too): the same values, bit for bit
    for extra in ({"ROW_LOADS": True}, {"ROW_LOADS": True, "PERSISTENT": 2}):
        rows = tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(cfg, **extra))
        assert torch.equal(one_per_tile, rows), (fmt, extra)
    plain_dx = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=dict(cfg))
    rows_dx = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=dict(cfg, ROW_LOADS=True))
    assert torch.equal(plain_dx, rows_dx), fmt
    # fold_scales (MXFP4 decoded with one multiply by 2^(s - 1) where every scale byte is at most 128; INT4 unchanged):
    # the same values bit for bit, scales 0..128 (the subnormal 2^-127 and 2^1 included)
    wsf = ws.clone()
    if fmt == "mxfp4-pack-quantized":
        wsf = torch.randint(0, 129, ws.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
        wsf.view(-1)[:2] = torch.tensor([0, 128], dtype=torch.uint8)
        assert kernel_format_id(FMT_MXFP4, wsf, True) == FMT_MXFP4_FOLDED
    for extra in ({}, {"ROW_LOADS": True}):
        for op in (tw.grouped_gemm, tw.grouped_gemm_dgrad):
            a = x if op is tw.grouped_gemm else dy
            exact = op(a, wp, wsf, fmt, splits, config=dict(cfg, **extra))
            folded = op(a, wp, wsf, fmt, splits, config=dict(cfg, **extra), fold_scales=True)
            assert torch.equal(exact, folded), (fmt, op.__name__, extra)
    # the last wave's tiles split over the reduction (TAIL_SPLIT, SLOTS_PER_SM; one program per "SM" here): 6 tiles of
    # 5 steps on 4 slots leave 2 tiles in 2 pieces; on 20 slots every tile in 3; every tail tile's counter ends at its
    # piece count. Each piece adds its steps' products to its own sum and the pieces' sums are added in piece order,
    # which groups the additions differently from the unsplit sum; on exact data (small integer activations, INT4
    # scales a power of two: every product and sum below is a multiple of 2^-10 under 2^11, exact in fp32) both
    # orders give the same bits
    def exact_case(K, seed):
        wp, ws = random_packed(fmt, E, 64, K, seed=seed)
        if fmt != "mxfp4-pack-quantized":
            ws = torch.full_like(ws, 2.0 ** -6)
        x = torch.randint(-3, 4, (25, K), generator=torch.Generator().manual_seed(seed)).bfloat16()
        return x, wp, ws
    x6, wp6, ws6 = exact_case(640, 7)
    one_pass = tw.grouped_gemm(x6, wp6, ws6, fmt, splits, config=dict(cfg, ROW_LOADS=True))
    for slots, full, pieces in ((4, 4, 2), (20, 0, 3)):
        assert tail_pieces(6, slots, 4, 5) == (full, pieces)
        counters = []
        zeros = torch.zeros
        torch.zeros = lambda *a, **k: counters.append(zeros(*a, **k)) or counters[-1]
        try:
            split_y = tw.grouped_gemm(x6, wp6, ws6, fmt, splits,
                                      config=dict(cfg, ROW_LOADS=True, TAIL_SPLIT=4, SLOTS_PER_SM=slots))
        finally:
            torch.zeros = zeros
        assert [c.tolist() for c in counters] == [[pieces] * (6 - full)], (fmt, slots, counters)
        assert torch.equal(split_y, one_pass), (fmt, slots)
    # two K steps per loop iteration (K_PAIRS, where K % 256 == 0: 3 pairs here): the same products added in the same
    # order, so the same bits; also split in 3 one-pair pieces on 20 slots (exact data, as above); K = 640 ignores it
    # (5 single steps)
    x7, wp7, ws7 = exact_case(768, 8)
    single = tw.grouped_gemm(x7, wp7, ws7, fmt, splits, config=dict(cfg, ROW_LOADS=True))
    for extra in ({}, {"TAIL_SPLIT": 4, "SLOTS_PER_SM": 20}):
        pairs = tw.grouped_gemm(x7, wp7, ws7, fmt, splits, config=dict(cfg, ROW_LOADS=True, K_PAIRS=True, **extra))
        assert torch.equal(pairs, single), (fmt, extra)
    ref7 = oracle_fwd(x7, wp7, ws7, fmt, splits)
    worst = max(worst, ((pairs.float() - ref7).norm() / ref7.norm()).item())
    odd = tw.grouped_gemm(x6, wp6, ws6, fmt, splits, config=dict(cfg, ROW_LOADS=True, K_PAIRS=True))
    assert torch.equal(odd, one_pass), fmt
    # the launchers' own configs where K rules out the permuted kernels (their options must not reach the generic ones)
    wp5, ws5 = random_packed(fmt, 2, 32, 160, seed=5)
    x5, dy5 = torch.randn(9, 160).bfloat16(), torch.randn(9, 32).bfloat16()
    for got, ref in ((tw.grouped_gemm(x5, wp5, ws5, fmt, [4, 5]), oracle_fwd(x5, wp5, ws5, fmt, [4, 5])),
                     (tw.grouped_gemm_dgrad(dy5, wp5, ws5, fmt, [4, 5]), oracle_dgrad(dy5, wp5, ws5, fmt, [4, 5]))):
        worst = max(worst, ((got.float() - ref).norm() / ref.norm()).item())
# a split dgrad's fp32 partial sums into its bf16 output in one pass (and torch's sum for a strided output): sums of
# multiples of 1/16 under 16 in magnitude, exact in fp32 and in bf16, so equal to the float64 sum whatever the rounding
for split, (T, K) in ((2, (25, 40)), (4, (7, 448))):
    part = (torch.randint(-63, 64, (split, T, K), generator=torch.Generator().manual_seed(split)) / 16).float()
    want = part.double().sum(0).to(torch.bfloat16)
    out = torch.full((T, K), float("nan"), dtype=torch.bfloat16)
    tw.sum_partials(part, out)
    assert torch.equal(out, want), split
    strided = torch.full((K, T), float("nan"), dtype=torch.bfloat16).t()
    tw.sum_partials(part, strided)
    assert torch.equal(strided, want), split
print("WORST", worst)
"""


def test_triton_kernels_in_interpreter():
    """The Triton kernels (portable decode, permuted and plain tilings) run in TRITON_INTERPRET on CPU."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT, here],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here)))),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("WORST")[-1])
    # the interpreter rounds bf16 by truncation, hence a looser bound than on the GPU
    assert worst < 1e-2, res.stdout


def test_tail_pieces():
    """The forward's last-wave split (:func:`plans.tail_pieces`): whole waves run whole, the tiles left split
    in as many pieces as one wave of slots holds, capped, none of them empty."""
    from kimi_core.kernels.w4a16.fused.plans import tail_pieces

    assert tail_pieces(1536, 660, 4, 56) == (1320, 3)  # K2 fc1 at 8 tok/exp: 216 tiles left, 3 x 216 <= 660
    assert tail_pieces(2688, 660, 4, 16) == (2688, 1)  # K2 fc2: 48 left, under a quarter of the slots: no split
    assert tail_pieces(825, 660, 4, 16) == (660, 4)  # 165 left, a quarter: 4 pieces
    assert tail_pieces(824, 660, 4, 16) == (824, 1)  # 164: under a quarter
    assert tail_pieces(1320, 660, 4, 56) == (1320, 1)  # whole waves only
    assert tail_pieces(6272, 660, 4, 24) == (5940, 1)  # 332 left: two pieces each would not fit in one wave
    assert tail_pieces(300, 660, 4, 56) == (0, 2)  # under one wave: every tile in 2
    assert tail_pieces(6, 4, 4, 5) == (4, 2)  # 2 left, 2 pieces of (3, 2) steps
    assert tail_pieces(6, 20, 4, 5) == (0, 3)  # 4 pieces of 5 steps would leave one empty: 3 (2, 2, 1)
    assert tail_pieces(100, 0, 4, 56) == (100, 1)  # no slot count: no split


def test_dgrad_occupancy_plan():
    """The shipped dgrad's launch plan (:func:`plans.dgrad_occupancy`) at the benchmark shapes with 8 tokens
    per expert on 132 SMs, as docs/performance.md#w4a16-launch-plans measured: K2 fc2's 192 programs split in 2
    and capped at 96 registers, K2 fc1's 672 split in 4 and capped (both formats), K3's 1344-1568 capped whole with
    the folded MXFP4 decode only; 64-row tiles (over 16 tokens per expert) are never capped, split in 4 under 2
    programs per SM."""
    from kimi_core.kernels.w4a16.format_ids import FMT_INT4, FMT_MXFP4, FMT_MXFP4_FOLDED
    from kimi_core.kernels.w4a16.fused import plans as tw

    folded, exact, int4 = FMT_MXFP4_FOLDED, FMT_MXFP4, FMT_INT4
    small = tw.dgrad_config(8, MXFP4_FORMAT)
    split, cap = dict(BLOCK_N=64, SPLIT_N=4), dict(maxnreg=96)
    split2 = dict(split, SPLIT_N=2, **cap)
    for programs, fmt, extra in [
        (192, folded, split2),
        (192, int4, split2),
        (192, exact, split2),
        (672, folded, dict(split, **cap)),
        (672, int4, dict(split, **cap)),
        (672, exact, dict(split, **cap)),
        (1568, folded, cap),
        (1344, folded, cap),
        (1568, int4, {}),
        (1568, exact, {}),
    ]:
        assert tw.dgrad_occupancy(small, programs, 132, fmt) == dict(small, **extra), (programs, fmt)
    wide = tw.dgrad_config(128, MXFP4_FORMAT)
    assert tw.dgrad_occupancy(wide, 192, 132, folded) == dict(wide, **split)
    assert tw.dgrad_occupancy(wide, 672, 132, folded) == wide
