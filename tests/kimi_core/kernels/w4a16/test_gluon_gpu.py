"""The Gluon W4A16 register kernels (:mod:`kimi_core.kernels.w4a16.gluon`), forward and dgrad, on a Hopper GPU
against the float32 oracle of exactly dequantized weights (GPU only, never in CI)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from utils import assert_close

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import FORMATS, MXFP4, oracle_dgrad, oracle_fwd, ragged_splits, random_packed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability(0)[0] != 9:
    pytest.skip("the Gluon kernel is written for Hopper (wgmma)", allow_module_level=True)


def every_scale(ws: torch.Tensor, seed: int) -> torch.Tensor:
    """Random scales of ``ws``'s shape and dtype over the whole range the decode must reproduce: E8M0 bytes 0..250
    (0 is the subnormal 2^-127; above 250 a code times its scale overflows bf16 and ``0 * inf`` poisons an identity
    product), or bf16 INT4 scales of magnitude 2^-133 .. 2^20 (subnormals, normals, both signs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ws.dtype == torch.uint8:
        return torch.randint(0, 251, ws.shape, dtype=torch.uint8, device="cuda", generator=g)
    return (
        torch.randn(ws.shape, device="cuda", generator=g)
        * torch.exp2(torch.randint(-133, 20, ws.shape, device="cuda", generator=g).float())
    ).bfloat16()


def read_back_weights(kernel: str, wp, ws, fmt: str, e: int, block_n: int, kw: dict) -> dict[str, torch.Tensor]:
    """Expert ``e``'s decoded weights ``[N, K]`` as ``kernel`` computes them, read back through an identity
    activation (one product per output, ``1 * w``): ``"registers"`` the register forward (``W^T``, transposed back),
    ``"registers-dgrad"`` the register dgrad (``W``); keyed by op."""
    from kimi_core.kernels.w4a16 import gluon as rs

    E, N, K = wp.shape[0], ws.shape[1], ws.shape[2] * 32
    fwd_splits, dgrad_splits = ([K if i == e else 0 for i in range(E)], [N if i == e else 0 for i in range(E)])
    eye_k, eye_n = torch.eye(K, device=wp.device).bfloat16(), torch.eye(N, device=wp.device).bfloat16()
    if kernel == "registers":
        return {"fwd": rs.grouped_gemm(eye_k, wp, ws, fmt, fwd_splits, block_n=block_n, **kw).t()}
    # the dgrad: the fragment's rows are the output columns reordered
    return {"dgrad": rs.grouped_gemm_dgrad(eye_n, wp, ws, fmt, dgrad_splits, block_n=block_n, **kw)}


def assert_bit_exact(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    same = got == want
    assert bool(same.all()), (
        f"{label}: {int((~same).sum())} decoded weights differ from "
        f"kimi_core.quant.dequantize, first at {(~same).nonzero()[0].tolist()}"
    )


@pytest.mark.parametrize(
    "kernel,block_n,rs_kw",
    [
        ("registers", 256, {}),
        ("registers", 128, {}),
        ("registers", 128, {"decode_ahead": True}),
        ("registers-dgrad", 256, {}),
        ("registers-dgrad", 128, {}),
        ("registers-dgrad", 128, {"decode_ahead": True}),
        # scales above 128: the fold is refused, the exact decode runs
        ("registers", 128, {"decode_ahead": True, "fold_scales": True}),
        ("registers-dgrad", 256, {"fold_scales": True}),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gluon_decoded_weights_are_bit_exact_over_every_scale(fmt, kernel, block_n, rs_kw):
    """An identity activation reads the decoded weights back exactly (one product per output, ``1 * w``): forward
    gives ``W^T``, dgrad ``W``; both must equal :func:`kimi_core.quant.dequantize` over every scale
    (:func:`every_scale`), for the register-fragment forward (two warpgroups of 128 or of 64 weight rows; decode
    ahead) and its dgrad
    (fragment rows = output columns reordered, transposed scales; 256 / 128 columns, decode ahead). Exact
    equality (``==``: the fp32 sum of the identity row cannot keep a weight's sign of zero, so -0 reads back as
    +0)."""
    from kimi_core.kernels.w4a16 import gluon
    from kimi_core.quant import dequantize

    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    E, N, K = 2, 256, 512
    wp, ws = random_packed(fmt, E, N, K, seed=3, device="cuda")
    ws = every_scale(ws, seed=4)
    for e in range(E):
        want = dequantize(fmt, wp[e], ws[e], torch.bfloat16)  # [N, K]
        for name, w in read_back_weights(kernel, wp, ws, fmt, e, block_n, rs_kw).items():
            assert_bit_exact(f"gluon {kernel} {rs_kw} {name} {fmt} block_n {block_n} expert {e}", w, want)


@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gluon_padded_scales_decode_bit_exact(fmt, block_n):
    """K = 384 (12 scale groups a row: 12 bytes for MXFP4, 24 for INT4, no multiple of 16): the forward reads the
    launcher's padded copy of the scales; an identity activation reads every decoded weight back equal to
    :func:`kimi_core.quant.dequantize`, over every scale."""
    from kimi_core.kernels.w4a16 import gluon
    from kimi_core.quant import dequantize

    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    E, N, K = 2, 256, 384
    wp, ws = random_packed(fmt, E, N, K, seed=12, device="cuda")
    ws = every_scale(ws, seed=13)
    for e in range(E):
        want = dequantize(fmt, wp[e], ws[e], torch.bfloat16)
        for name, w in read_back_weights("registers", wp, ws, fmt, e, block_n, {}).items():
            assert_bit_exact(f"gluon padded scales {name} {fmt} block_n {block_n} expert {e}", w, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_gluon_path_through_autograd_with_device_splits(fmt):
    """``path="gluon"`` through the public autograd op (as the Megatron experts call it): ``m_splits`` a CUDA tensor,
    ragged and empty experts, masked N; forward and the dgrad of its backward against the fp32 oracle."""
    from kimi_core import kernels

    E, K, N = 9, 1024, 328
    splits = ragged_splits(E, 40, seed=5)
    assert 0 in splits
    wp, ws = random_packed(fmt, E, N, K, seed=6, device="cuda")
    T = sum(splits)
    x = torch.randn(T, K, device="cuda").bfloat16().requires_grad_()
    dev_splits = torch.tensor(splits, device="cuda")
    y = kernels.w4a16_grouped_linear(x, wp, ws, fmt, dev_splits, path="gluon")
    g = torch.randn_like(y)
    y.backward(g)
    assert_close(f"gluon path fwd {fmt}", oracle_fwd(x.detach(), wp, ws, fmt, splits), y.detach().float(), 1e-2)
    assert_close(f"gluon path dgrad {fmt}", oracle_dgrad(g, wp, ws, fmt, splits), x.grad.float(), 1e-2)


def register_kernel_against_oracle(op: str, fmt: str, E: int, K: int, N: int, mean: int, kw: dict, seed: int) -> None:
    """The register kernels' forward (``op`` ``"fwd"``: ``x [T, K] -> y [T, N]``) or dgrad (``dy [T, N] -> dx [T,
    K]``) with options ``kw`` on ragged experts around ``mean`` rows (some empty), into a NaN-poisoned output so
    unwritten rows show, against the fp32 oracle of exactly dequantized weights."""
    from kimi_core.kernels.w4a16 import gluon as rs

    if not rs.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    splits = ragged_splits(E, mean, seed=E)
    assert 0 in splits
    wp, ws = random_packed(fmt, E, N, K, seed=seed, device="cuda")
    a_cols, out_cols = (K, N) if op == "fwd" else (N, K)
    a = torch.randn(sum(splits), a_cols, device="cuda").bfloat16()
    out = torch.full((a.shape[0], out_cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    (rs.grouped_gemm if op == "fwd" else rs.grouped_gemm_dgrad)(a, wp, ws, fmt, splits, out=out, **kw)
    torch.cuda.synchronize()
    oracle = oracle_fwd if op == "fwd" else oracle_dgrad
    assert_close(f"gluon rs {op} {fmt} E{E} K{K} N{N} {kw}", oracle(a, wp, ws, fmt, splits), out.float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "E,K,N,mean,kw",
    [
        pytest.param(112, 3584, 6144, 128, {}, id="K3-fc1-128tok"),
        pytest.param(112, 3584, 6144, 128, {"persistent": True}, id="K3-fc1-128tok-persistent"),
        pytest.param(24, 2048, 7168, 8, {}, id="K2-fc2-8tok"),
        pytest.param(7, 512, 200, 70, {"block_m": 16, "load_stages": 3, "persistent": 3}, id="masked-N-16rows-3prog"),
        pytest.param(7, 512, 200, 70, {"block_m": 64, "load_stages": 2}, id="masked-N-64rows-2stages"),
        # 128-column tiles (two warpgroups of 64 weight rows), up to 256 rows per tile
        pytest.param(16, 3584, 6144, 600, {"block_n": 128}, id="K3-fc1-600tok-256rows"),
        pytest.param(16, 3584, 6144, 600, {"block_n": 128, "persistent": True}, id="K3-fc1-600tok-256rows-persistent"),
        pytest.param(24, 2048, 7168, 8, {"block_n": 128}, id="K2-fc2-8tok-n128"),
        pytest.param(
            7,
            512,
            200,
            300,
            {"block_n": 128, "block_m": 256, "load_stages": 2, "persistent": 3},
            id="masked-N-256rows-2stages-3prog",
        ),
        pytest.param(7, 512, 72, 70, {"block_n": 128, "block_m": 128, "persistent": 2}, id="masked-N72-128rows-2prog"),
        # scale rows of no multiple of 16 bytes (MXFP4 K 384 / 768, INT4 K 384: K3 fc2 at expert TP 8 / 4): the
        # launcher's padded copy of the scales
        pytest.param(7, 384, 200, 70, {}, id="K384-padded-scales"),
        pytest.param(9, 768, 256, 130, {"block_n": 128, "decode_ahead": True}, id="K768-padded-scales-ahead"),
        # decode ahead (step i + 1 decoded while step i's wgmma runs; the pipeline unrolled by two): the fewest steps
        # (K 512: 8), rings that wrap across tiles, few rows
        pytest.param(112, 3584, 6144, 128, {"decode_ahead": True}, id="K3-fc1-128tok-ahead"),
        pytest.param(
            16, 3584, 6144, 600, {"decode_ahead": True, "persistent": True}, id="K3-fc1-600tok-ahead-persistent"
        ),
        pytest.param(
            7,
            512,
            200,
            300,
            {"decode_ahead": True, "block_m": 256, "load_stages": 2, "persistent": 3},
            id="masked-N-8steps-ahead-256rows-3prog",
        ),
        pytest.param(
            7,
            512,
            200,
            70,
            {"decode_ahead": True, "block_m": 16, "load_stages": 3, "persistent": 2},
            id="masked-N-8steps-ahead-16rows-2prog",
        ),
    ],
)
def test_gluon_rs_forward_matches_oracle(fmt, E, K, N, mean, kw):
    """The forward with the weights decoded into the wgmma's register fragment (two warpgroups on the two halves
    of a 256- or 128-column tile, 128-column tiles up to 256 rows) on ragged and empty experts, masked N (200 of 256
    columns), persistent programs and rings that wrap across tiles, against the fp32 oracle."""
    register_kernel_against_oracle("fwd", fmt, E, K, N, mean, kw, seed=7)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "E,K,N,mean,kw",
    [
        pytest.param(112, 3584, 6144, 128, {}, id="K3-fc1-128tok"),
        pytest.param(112, 3584, 6144, 128, {"persistent": True}, id="K3-fc1-128tok-persistent"),
        pytest.param(24, 2048, 7168, 8, {}, id="K2-fc2-8tok"),
        pytest.param(16, 3584, 6144, 600, {"block_n": 128, "persistent": True}, id="K3-fc1-600tok-256rows-persistent"),
        pytest.param(
            16, 3584, 6144, 600, {"decode_ahead": True, "persistent": True}, id="K3-fc1-600tok-ahead-persistent"
        ),
        pytest.param(16, 3072, 3584, 600, {"decode_ahead": True}, id="K3-fc2-600tok-ahead"),
        pytest.param(16, 3584, 6144, 600, {"decode_ahead": "auto", "persistent": True}, id="K3-fc1-600tok-auto-ahead"),
        # N (the contraction) not a multiple of 64: the last step's rows past N meet dy's zero fill (N 200: 4 steps,
        # 584: 10, 328: 6); odd step counts under decode ahead's pairs (N 136: 3 steps, 64: 1)
        pytest.param(7, 512, 200, 70, {"block_m": 16, "load_stages": 3, "persistent": 3}, id="N200-16rows-3prog"),
        pytest.param(
            7,
            512,
            584,
            300,
            {"block_n": 128, "block_m": 256, "load_stages": 2, "persistent": 3},
            id="N584-256rows-2stages-3prog",
        ),
        pytest.param(
            7, 512, 584, 300, {"decode_ahead": True, "load_stages": 2, "persistent": 2}, id="N584-ahead-2stages-2prog"
        ),
        pytest.param(9, 1024, 328, 40, {"decode_ahead": True, "block_m": 16}, id="N328-ahead-16rows"),
        pytest.param(9, 1024, 136, 40, {"decode_ahead": True, "block_m": 64}, id="N136-3steps-ahead"),
        pytest.param(5, 512, 64, 70, {"decode_ahead": True}, id="N64-1step-ahead"),
        # K (the output columns) 384 / 768: K3 fc2 at expert TP 8 / 4; column tiles past K masked
        pytest.param(7, 384, 200, 70, {}, id="K384"),
        pytest.param(9, 768, 512, 130, {"decode_ahead": True, "persistent": True}, id="K768-ahead-persistent"),
    ],
)
def test_gluon_rs_dgrad_matches_oracle(fmt, E, K, N, mean, kw):
    """The dgrad with the weights decoded into the wgmma's register fragment (``gluon.grouped_gemm_dgrad``:
    rows of the fragment are the output columns reordered, scales transposed per call) on ragged and empty experts,
    contraction lengths that are no multiple of 64 and odd step counts (decode ahead's pairs), persistent programs
    whose rings wrap across tiles, against the fp32 oracle."""
    register_kernel_against_oracle("dgrad", fmt, E, K, N, mean, kw, seed=8)


@pytest.mark.parametrize(
    "op,block_n,kw",
    [
        ("fwd", 128, {"decode_ahead": True}),
        ("fwd", 256, {}),
        ("dgrad", 128, {"decode_ahead": True}),
        ("dgrad", 256, {}),
    ],
)
def test_folded_mxfp4_decode_is_bit_exact(op, block_n, kw):
    """MXFP4 with the decode's ``2^126`` folded into the scales (``fold_scales``: one multiply per decoded pair, by
    ``2^(s - 1)``) over every E8M0 byte it takes (0..128): an identity activation reads the decoded weights back
    equal to :func:`kimi_core.quant.dequantize`, forward (``W^T``) and dgrad (``W``)."""
    from kimi_core.kernels.w4a16 import gluon
    from kimi_core.kernels.w4a16.format_ids import mxfp4_scales_fold
    from kimi_core.quant import dequantize

    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    fmt = MXFP4
    E, N, K = 2, 256, 512
    wp, _ = random_packed(fmt, E, N, K, seed=9, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(10)
    ws = torch.randint(0, 129, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
    assert mxfp4_scales_fold(ws), "every byte is at most 128: the folded decode must run"
    kernel = "registers" if op == "fwd" else "registers-dgrad"
    for e in range(E):
        want = dequantize(fmt, wp[e], ws[e], torch.bfloat16)  # [N, K]
        (w,) = read_back_weights(kernel, wp, ws, fmt, e, block_n, {**kw, "fold_scales": True}).values()
        assert_bit_exact(f"folded {op} block_n {block_n} {kw} expert {e}", w, want)


def test_unread_scales_under_graph_capture_take_the_exact_decode():
    """``fold_scales`` needs one read of the scale tensor (a device sync), which is illegal while a CUDA graph is
    captured: a tensor not read before the capture takes the exact two-multiply decode inside the graph, without a
    read, and the graph's outputs are bitwise the eager folded call's (forward and dgrad), which the oracle checks."""
    from kimi_core.kernels.w4a16 import gluon as rs

    if not rs.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from kimi_core.kernels.w4a16.format_ids import mxfp4_scales_fold

    E, N, K = 3, 256, 512
    splits = [40, 0, 88]
    wp, ws = random_packed(MXFP4, E, N, K, seed=11, device="cuda")
    x = torch.randn(sum(splits), K, device="cuda").bfloat16()
    dy = torch.randn(sum(splits), N, device="cuda").bfloat16()
    unfolded = ws.clone()
    unfolded[0, 0, 0] = 129  # compiles the two-multiply kernels outside the capture
    rs.grouped_gemm(x, wp, unfolded, MXFP4, splits, fold_scales=True)
    rs.grouped_gemm_dgrad(dy, wp, unfolded, MXFP4, splits, fold_scales=True)
    fresh = ws.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = rs.grouped_gemm(x, wp, fresh, MXFP4, splits, fold_scales=True)
        dx_graph = rs.grouped_gemm_dgrad(dy, wp, fresh, MXFP4, splits, fold_scales=True)
    graph.replay()
    torch.cuda.synchronize()
    assert not hasattr(fresh, "_kimi_scales_fold"), "the scales were read during the capture"
    y = rs.grouped_gemm(x, wp, ws, MXFP4, splits, fold_scales=True)
    dx = rs.grouped_gemm_dgrad(dy, wp, ws, MXFP4, splits, fold_scales=True)
    assert mxfp4_scales_fold(ws), "the eager calls must run the folded decode"
    assert torch.equal(y_graph, y) and torch.equal(dx_graph, dx), "captured (exact) and eager (folded) differ"
    assert_close("graph fwd", oracle_fwd(x, wp, ws, MXFP4, splits), y.float(), 1e-2)
    assert_close("graph dgrad", oracle_dgrad(dy, wp, ws, MXFP4, splits), dx.float(), 1e-2)
