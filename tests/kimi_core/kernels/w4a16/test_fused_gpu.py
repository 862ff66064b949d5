"""Triton W4A16 grouped GEMM on the GPU against the float32 oracle (run on the H200, never in CI)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_close

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, INT4, MXFP4, oracle_dgrad, oracle_fwd, ragged_splits, random_packed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# the benchmark shapes (E, K, N) plus odd ones for the generic kernels
BENCH_SHAPES = [
    pytest.param(112, 3584, 6144, id="K3-fc1"),
    pytest.param(112, 3072, 3584, id="K3-fc2"),
    pytest.param(24, 7168, 4096, id="K2-fc1"),
    pytest.param(24, 2048, 7168, id="K2-fc2"),
]
ODD_SHAPES = [
    pytest.param(5, 160, 96, id="K160-generic-fwd-dgrad"),
    pytest.param(3, 384, 200, id="K384-N200-perm-fwd-generic-dgrad"),
    pytest.param(7, 512, 136, id="K512-N136-masked-N"),
]


def _run(fmt, E, K, N, splits, seed, tensor_splits=False, scale_range=(118, 124)):
    from kimi_core.kernels.w4a16.fused import launch as tw

    dev = "cuda"
    wp, ws = random_packed(fmt, E, N, K, seed=seed, device=dev, scale_range=scale_range)
    T = sum(splits)
    x = torch.randn(T, K, device=dev).bfloat16()
    dy = torch.randn(T, N, device=dev).bfloat16()
    ms = torch.tensor(splits, device=dev) if tensor_splits else splits
    y = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)  # poison: unwritten rows show
    dx = torch.full((T, K), float("nan"), dtype=torch.bfloat16, device=dev)
    tw.grouped_gemm(x, wp, ws, fmt, ms, out=y)
    tw.grouped_gemm_dgrad(dy, wp, ws, fmt, ms, out=dx)
    torch.cuda.synchronize()
    assert_close(f"fwd {fmt} E{E} K{K} N{N} T{T}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)
    assert_close(f"dgrad {fmt} E{E} K{K} N{N} T{T}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
def test_bench_shapes_small_ragged(fmt, E, K, N):
    """Every benchmark shape, few ragged tokens per expert with empty experts, matches the oracle."""
    _run(fmt, E, K, N, ragged_splits(E, 9, seed=E + N), seed=K)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "E,K,N,mean",
    [pytest.param(112, 3584, 6144, 40, id="K3-fc1-mean40"), pytest.param(24, 7168, 4096, 300, id="K2-fc1-mean300")],
)
def test_bench_shapes_larger_tiles(fmt, E, K, N, mean):
    """Larger ragged batches take the 32/64/128-row tiles and still match the oracle."""
    _run(fmt, E, K, N, ragged_splits(E, mean, seed=mean), seed=mean)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", ODD_SHAPES)
def test_odd_shapes_and_device_splits(fmt, E, K, N):
    """K not a multiple of the tile, masked N, device-tensor m_splits (upper-bound grid)."""
    _run(fmt, E, K, N, ragged_splits(E, 23, seed=K), seed=N, tensor_splits=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("tensor_splits", [False, True])
def test_dgrad_split_reduction(fmt, split, tensor_splits):
    """The permuted dgrad with its reduction over N split into ``SPLIT_N`` ranges (fp32 partial sums, summed by the
    launcher), at K2 fc2's shape (N = 7168 in 112 steps, 3 does not divide it evenly) with ragged and empty experts
    and device splits (the upper-bound grid), matches the oracle and leaves no row unwritten."""
    from kimi_core.kernels.w4a16.fused import launch as tw

    E, K, N = 24, 2048, 7168
    splits = ragged_splits(E, 9, seed=split)
    wp, ws = random_packed(fmt, E, N, K, seed=split, device="cuda")
    dy = torch.randn(sum(splits), N, device="cuda").bfloat16()
    dx = torch.full((sum(splits), K), float("nan"), dtype=torch.bfloat16, device="cuda")
    ms = torch.tensor(splits, device="cuda") if tensor_splits else splits
    cfg = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SPLIT_N=split)
    tw.grouped_gemm_dgrad(dy, wp, ws, fmt, ms, config=cfg, out=dx)
    assert_close(f"dgrad split {split} {fmt}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)


@pytest.mark.parametrize(
    "variant",
    [
        {"PERSISTENT": 2},
        {"ROW_LOADS": True},
        {"ROW_LOADS": True, "PERSISTENT": 2},
        {"ROW_LOADS": True, "K_PAIRS": True, "num_stages": 3},
    ],
    ids=["persistent", "row-loads", "row-loads-persistent", "row-loads-k-pairs"],
)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
@pytest.mark.parametrize("tensor_splits", [False, True])
@pytest.mark.parametrize("tokens", [9, 30])
def test_forward_variants(fmt, E, K, N, tensor_splits, variant, tokens):
    """The permuted forward's options at each benchmark shape with few ragged tokens per expert and empty experts,
    host and device splits: the experimental persistent walk (2 programs per SM, every tile in one flattened loop
    nest), the weights loaded as one contiguous run per row (``ROW_LOADS``) and two K steps per iteration
    (``K_PAIRS``, every benchmark K a multiple of 256) give bit for bit the one-program-per-tile result with the
    weights loaded ``[BN, 4, 4]``, and the oracle's."""
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    splits = ragged_splits(E, tokens, seed=K)
    wp, ws = random_packed(fmt, E, N, K, seed=N, device="cuda")
    x = torch.randn(sum(splits), K, device="cuda").bfloat16()
    ms = torch.tensor(splits, device="cuda") if tensor_splits else splits
    # one program per tile, none split, one K step per iteration
    base = dict(plans.fwd_config(tokens, fmt), ROW_LOADS=False, TAIL_SPLIT=1, K_PAIRS=False)
    one_per_tile = tw.grouped_gemm(x, wp, ws, fmt, ms, config=dict(base))
    y = torch.full_like(one_per_tile, float("nan"))
    tw.grouped_gemm(x, wp, ws, fmt, ms, config=dict(base, **variant), out=y)
    assert torch.equal(y, one_per_tile)
    assert_close(f"{variant} fwd {fmt} E{E} K{K} N{N}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
@pytest.mark.parametrize("tensor_splits", [False, True])
def test_dgrad_row_loads(fmt, E, K, N, tensor_splits, split):
    """The permuted dgrad with its weights loaded as runs along each row (``ROW_LOADS``), whole or with the reduction
    split in 4, at each benchmark shape with few ragged tokens per expert and empty experts: bit for bit the result
    with the weights loaded ``[BN, 4, 2, 4]``, and the oracle's."""
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    splits = ragged_splits(E, 9, seed=N)
    wp, ws = random_packed(fmt, E, N, K, seed=K, device="cuda")
    dy = torch.randn(sum(splits), N, device="cuda").bfloat16()
    ms = torch.tensor(splits, device="cuda") if tensor_splits else splits
    base = dict(plans.dgrad_config(9, fmt), ROW_LOADS=False, SPLIT_N=split)
    plain = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, ms, config=dict(base))
    dx = torch.full_like(plain, float("nan"))
    tw.grouped_gemm_dgrad(dy, wp, ws, fmt, ms, config=dict(base, ROW_LOADS=True), out=dx)
    assert torch.equal(dx, plain)
    assert_close(
        f"row-loads dgrad split {split} {fmt} E{E} K{K} N{N}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2
    )


@pytest.mark.parametrize("variant", [{"maxnreg": 96}, {"num_warps": 8}], ids=["maxnreg-96", "8-warps"])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
def test_dgrad_occupancy_variants(fmt, E, K, N, split, variant):
    """The 8 tok/exp sweep's dgrad variants with more programs per SM, at each benchmark shape with few ragged tokens
    per expert and empty experts, whole or split in 2 or 4: a register cap of 96 (the same code, allocated in fewer
    registers) gives bit for bit the shipped tile's result; 8 warps (each wgmma over half the tile) the oracle's."""
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    splits = ragged_splits(E, 9, seed=K + split)
    wp, ws = random_packed(fmt, E, N, K, seed=N, device="cuda")
    dy = torch.randn(sum(splits), N, device="cuda").bfloat16()
    base = dict(plans.dgrad_config(9, fmt), SPLIT_N=split)
    shipped = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=dict(base), fold_scales=True)
    dx = torch.full_like(shipped, float("nan"))
    tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=dict(base, **variant), out=dx, fold_scales=True)
    if "maxnreg" in variant:
        assert torch.equal(dx, shipped)
    assert_close(
        f"{variant} dgrad split {split} {fmt} E{E} K{K} N{N}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2
    )


def test_mxfp4_wide_scale_range():
    """E8M0 scales above 2^1 (s > 128) and tiny ones decode exactly (the two-multiply path)."""
    _run(MXFP4, 4, 256, 128, [17, 0, 40, 3], seed=5, scale_range=(60, 150))


@pytest.mark.parametrize("fmt", FORMATS)
def test_public_api_and_autograd_on_cuda(fmt):
    """The public op dispatches to Triton on CUDA and its autograd backward equals the dgrad oracle."""
    from kimi_core.kernels import w4a16_grouped_linear

    E, K, N, splits = 6, 512, 256, [0, 33, 5, 0, 70, 1]
    wp, ws = random_packed(fmt, E, N, K, seed=11, device="cuda")
    x = torch.randn(sum(splits), K, device="cuda").bfloat16().requires_grad_()
    y = w4a16_grouped_linear(x, wp, ws, fmt, splits)
    g = torch.randn_like(y)
    y.backward(g)
    assert_close("y", oracle_fwd(x.detach(), wp, ws, fmt, splits), y.detach().float(), 1e-2)
    assert_close("dx", oracle_dgrad(g, wp, ws, fmt, splits), x.grad.float(), 1e-2)


@pytest.mark.parametrize("split", [2, 3, 4])
def test_sum_partials_rounds_once(split):
    """A split dgrad's fp32 partial sums summed into its bf16 output in one pass (:func:`launch.sum_partials`, K2 fc2's
    dgrad output at 8 tok/exp plus 5 rows): the float64 sum rounded once to bf16 (partials are multiples of 1/64 under
    4, so their sums are exact in fp32 but not in bf16), and within half a bf16 unit of it for normal random partials
    (plus the fp32 sum's own rounding). A last block cut short is checked in the interpreter
    (test_fused.py)."""
    from kimi_core.kernels.w4a16.fused import launch as tw

    T, K = 24 * 8 + 5, 2048
    g = torch.Generator(device="cuda").manual_seed(split)
    exact = torch.randint(-255, 256, (split, T, K), device="cuda", generator=g).float() / 64
    normal = torch.randn((split, T, K), device="cuda", generator=g)
    for name, part in (("exact", exact), ("normal", normal)):
        out = torch.full((T, K), float("nan"), dtype=torch.bfloat16, device="cuda")
        tw.sum_partials(part, out)
        want = part.double().sum(0)
        if name == "exact":
            assert torch.equal(out, want.to(torch.bfloat16)), split
        else:  # bf16 keeps 8 significant bits (a unit in the last place: 2^-7 of the value's binade); the fp32 sum
            # may be off by split units of 2^-24 of the partials' magnitudes (cancellation)
            ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
            fp32_err = split * 2.0**-24 * part.double().abs().sum(0)
            assert ((out.double() - want).abs() <= 0.5 * ulp + fp32_err).all(), split


@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_folded_mxfp4_decode(E, K, N, op):
    """The permuted kernels with ``fold_scales`` (MXFP4 decoded with one bf16x2 multiply by ``2^(s - 1)`` where every
    E8M0 byte is at most 128) over scale bytes 0..128 (the subnormal ``2^-127`` and ``2^1`` included), the shipped tiles
    at 8 tokens per expert (the launcher's own pick, K2 fc2's split dgrad included): bit for bit the two-multiply
    decode's result, and the oracle's."""
    from kimi_core.kernels.w4a16 import format_ids as ids
    from kimi_core.kernels.w4a16.fused import launch as tw

    splits = ragged_splits(E, 9, seed=E + K)
    wp, _ = random_packed(MXFP4, E, N, K, seed=N, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(K)
    ws = torch.randint(0, 129, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
    assert ids.kernel_format_id(ids.FMT_MXFP4, ws, True) == ids.FMT_MXFP4_FOLDED
    a = torch.randn(sum(splits), K if op == "fwd" else N, device="cuda").bfloat16()
    launch = tw.grouped_gemm if op == "fwd" else tw.grouped_gemm_dgrad
    exact = launch(a, wp, ws, MXFP4, splits)
    folded = launch(a, wp, ws, MXFP4, splits, fold_scales=True)
    assert torch.equal(exact, folded), f"folded {op} E{E} K{K} N{N}"
    oracle = oracle_fwd if op == "fwd" else oracle_dgrad
    assert_close(f"folded {op} E{E} K{K} N{N}", oracle(a, wp, ws, MXFP4, splits), folded.float(), 1e-2)


@pytest.mark.parametrize(
    "slots_per_sm,most,pairs",
    [(5, 4, False), (5, 2, False), (1, 4, False), (40, 4, False), (5, 4, True), (40, 4, True)],
)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
def test_forward_tail_split(fmt, E, K, N, slots_per_sm, most, pairs):
    """The forward with its last wave's tiles split over the reduction (``TAIL_SPLIT``, ``SLOTS_PER_SM``: 5 = the
    16x64 tile's resident programs per SM on sm_90a, 1 = many waves and a short tail, 40 = every tile split), at each
    benchmark shape with few ragged tokens per expert (one expert grown by a row tile at a time until the last wave
    splits) and empty experts: every output written, the oracle's result, the same bits on a second run (the last piece
    to finish adds the pieces in piece order) and within bf16 rounding of the unsplit tiles. ``pairs``: two K steps per
    iteration (``K_PAIRS``), the pieces cut at whole pairs."""
    from kimi_core.kernels.device import sm_count
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    splits = ragged_splits(E, 9, seed=K + slots_per_sm)
    cfg = dict(plans.fwd_config(9, fmt), TAIL_SPLIT=most, SLOTS_PER_SM=slots_per_sm, K_PAIRS=pairs)
    for grow in range(64):
        programs = tw.num_programs(splits, sum(splits), E, cfg["BLOCK_M"], -(-N // cfg["BLOCK_N"]))
        full, pieces = plans.tail_pieces(programs, slots_per_sm * sm_count("cuda"), most, plans.fwd_steps(K, pairs))
        if pieces > 1:
            break
        splits[grow % E] += cfg["BLOCK_M"]
    assert pieces > 1, "no split found"
    wp, ws = random_packed(fmt, E, N, K, seed=N, device="cuda")
    x = torch.randn(sum(splits), K, device="cuda").bfloat16()
    whole = tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(cfg, TAIL_SPLIT=1))  # every tile in one program
    runs = []
    for _ in range(2):
        y = torch.full_like(whole, float("nan"))
        tw.grouped_gemm(x, wp, ws, fmt, splits, config=dict(cfg), out=y)
        runs.append(y)
    assert torch.equal(runs[0], runs[1]), "the split forward is not deterministic"
    assert_close(
        f"tail split {pieces} from tile {full} of {programs} {fmt} E{E} K{K} N{N}",
        oracle_fwd(x, wp, ws, fmt, splits),
        runs[0].float(),
        1e-2,
    )
    assert_close(f"tail split vs whole tiles {fmt} E{E} K{K} N{N}", whole.float(), runs[0].float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resident_programs_follow_the_occupancy_rules(fmt):
    """The driver's count of resident forward programs per SM (:func:`kimi_core.kernels.occupancy.resident_programs`,
    which sizes the last-wave split) against the CUDA occupancy rules computed here from the compiled kernel's
    registers, shared memory and warps: registers allocated per warp in units of 256, 1 KiB of shared memory reserved
    per block, the SM's register file, shared memory and thread limits, at most 32 blocks."""
    from kimi_core.kernels.occupancy import resident_programs
    from kimi_core.kernels.w4a16 import format_ids as ids
    from kimi_core.kernels.w4a16.fused import forward, plans
    from kimi_core.kernels.w4a16.fused import launch as tw

    E, K, N = 24, 7168, 4096
    wp, ws = random_packed(fmt, E, N, K, seed=3, device="cuda")
    x = torch.randn(E * 8, K, device="cuda").bfloat16()
    y = torch.empty(E * 8, N, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(0, E + 1, device="cuda", dtype=torch.int32) * 8
    wq = tw.as_words(wp)
    cfg = plans.fwd_config(8, fmt)
    consts = dict(
        FMT=ids.format_id(fmt),
        GROUP_M=8,
        E_POW2=tw.e_pow2(E),
        USE_ASM=True,
        INTERP=False,
        PERSISTENT=False,
        ROW_LOADS=cfg["ROW_LOADS"],
        K_PAIRS=cfg.get("K_PAIRS", False),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    k = forward.w4a16_fwd_perm_kernel.warmup(
        x,
        wq,
        ws.contiguous(),
        y,
        offsets,
        N,
        K,
        E,
        x.stride(0),
        wq.stride(0),
        wq.stride(1),
        ws.stride(0),
        ws.stride(1),
        y.stride(0),
        grid=(1,),
        **consts,
    )
    got = resident_programs(k)
    props = torch.cuda.get_device_properties(0)
    warps = k.metadata.num_warps
    regs_per_warp = -(-k.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    by_shared = props.shared_memory_per_multiprocessor // (k.metadata.shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    want = min(by_regs, by_shared, by_threads, 32)
    print(
        f"{fmt}: {k.n_regs} registers, {k.metadata.shared} B shared, {warps} warps: {got} resident "
        f"(registers {by_regs}, shared {by_shared}, threads {by_threads})"
    )
    assert got == want > 0


@pytest.mark.parametrize("fmt,fold", [(MXFP4, True), (MXFP4, False), (INT4, False)])
def test_shipped_forward_splits_k2_fc1_last_wave(fmt, fold, monkeypatch):
    """The shipped forward at K2 fc1 with 8 tokens per expert (1536 tiles of 56 K steps, 28 loop iterations paired)
    splits its last wave as :func:`tail_pieces` says for the driver's resident-program counts, every tail tile's
    counter at its piece count afterwards, and matches the oracle. On 132 SMs: MXFP4 with the folded decode 5
    programs per SM split or not (2.33 waves on 660 slots, 216 tiles in 3 pieces); with the exact decode the split
    kernel holds 4 (as tools/kernels/fused_sm90_resources.py computes for sm_90a), so nothing splits."""
    from kimi_core.kernels.device import sm_count
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    E, K, N = 24, 7168, 4096
    splits = [8] * E
    wp, ws = random_packed(fmt, E, N, K, seed=5, device="cuda")
    x = torch.randn(sum(splits), K, device="cuda").bfloat16()
    tw.FWD_SLOTS_PER_SM.clear()  # so that the counts left afterwards are this call's
    counters, zeros = [], torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: counters.append(zeros(*a, **kw)) or counters[-1])
    y = tw.grouped_gemm(x, wp, ws, fmt, splits, fold_scales=fold)
    monkeypatch.undo()
    counters = [c for c in counters if c.numel() > 1]  # the count's own one-element warm-up counter aside
    cfg = plans.fwd_config(8, fmt)
    per_sm = {key[-1]: n for key, n in tw.FWD_SLOTS_PER_SM.items()}  # pieces (1: unsplit) -> programs per SM
    steps, sms = plans.fwd_steps(K, cfg.get("K_PAIRS", False)), sm_count("cuda")
    full, pieces = plans.tail_pieces(1536, per_sm[1] * sms, cfg["TAIL_SPLIT"], steps)
    if pieces > 1 and per_sm[pieces] < per_sm[1]:  # the split kernel holds fewer programs per SM: no split
        full, pieces = 1536, 1
    print(f"{fmt} fold={fold}: programs per SM {per_sm}, {1536 - full} tail tiles in {pieces} pieces")
    if pieces > 1:
        assert [c.tolist() for c in counters] == [[pieces] * (1536 - full)]
    else:
        assert counters == []
    if fmt == MXFP4 and sms == 132:
        assert (per_sm, full, pieces) == (({1: 5, 3: 5}, 1320, 3) if fold else ({1: 5, 3: 4}, 1536, 1)), (
            "the split this test was written for no longer happens"
        )
    assert_close(f"shipped fwd K2 fc1 {fmt} fold={fold}", oracle_fwd(x, wp, ws, fmt, splits), y.float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("E,K,N", BENCH_SHAPES)
def test_shipped_dgrad_occupancy_plan(fmt, E, K, N, monkeypatch):
    """The shipped dgrad at 8 tokens per expert with the folded MXFP4 decode launches what
    :func:`dgrad_occupancy` plans for its program count on this GPU (the plan read back from the launcher's call),
    bit for bit the same tile uncapped (a register cap changes the allocation, not the arithmetic), and matches the
    oracle."""
    from kimi_core.kernels.device import sm_count
    from kimi_core.kernels.w4a16 import format_ids as ids
    from kimi_core.kernels.w4a16.fused import launch as tw
    from kimi_core.kernels.w4a16.fused import plans

    splits = [8] * E
    wp, ws = random_packed(fmt, E, N, K, seed=E + K, device="cuda")
    dy = torch.randn(sum(splits), N, device="cuda").bfloat16()
    recorded, plan = [], plans.dgrad_occupancy
    # a copy of each plan: the launcher pops SPLIT_N and ROW_LOADS from the dict it gets back
    monkeypatch.setattr(tw, "dgrad_occupancy", lambda *a: recorded.append(dict(plan(*a))) or dict(recorded[-1]))
    dx = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, fold_scales=True)
    monkeypatch.undo()
    programs = E * (K // 256)
    want = plan(
        plans.dgrad_config(8, fmt), programs, sm_count("cuda"), ids.kernel_format_id(ids.format_id(fmt), ws, True)
    )
    print(f"{fmt} E{E} K{K} N{N}: {programs} programs, plan {recorded}")
    assert recorded == [want]
    uncapped = {k: v for k, v in want.items() if k != "maxnreg"}
    ref = tw.grouped_gemm_dgrad(dy, wp, ws, fmt, splits, config=uncapped, fold_scales=True)
    assert torch.equal(dx, ref)
    assert_close(f"shipped dgrad {fmt} E{E} K{K} N{N}", oracle_dgrad(dy, wp, ws, fmt, splits), dx.float(), 1e-2)
