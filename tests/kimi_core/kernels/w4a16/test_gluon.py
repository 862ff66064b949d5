"""CPU checks of the Gluon W4A16 backend's host side (:mod:`kimi_core.kernels.w4a16.gluon`): its tile table and
tile picks, and the options it refuses by name before anything launches (its GPU test: test_gluon_gpu.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kimi_core.kernels.w4a16.gluon import tiles
from kimi_core.kernels.w4a16.gluon.tiles import tile_table

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_cases import MXFP4, random_packed


def _needs_gluon():
    from kimi_core.kernels.w4a16.gluon import HAVE_GLUON

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")


@pytest.mark.parametrize("splits,block", [([0, 70, 1, 129], 64), ([5], 64), ([0, 0, 3], 16), ([0, 0], 64)])
def test_tile_table_covers_each_experts_rows_once(splits, block):
    """Every row of every expert lies in exactly one tile of that expert, no tile spans more than ``block`` rows
    or crosses into the next expert, and empty experts get none."""
    table = tile_table(splits, block, "cpu")
    assert table.dtype == torch.int32 and table.shape[1] == 3
    owner = []
    for e, m in enumerate(splits):
        owner += [e] * m
    seen = [0] * len(owner)
    for e, lo, end in table.tolist():
        hi = min(lo + block, end)
        assert 0 < hi - lo <= block and end == sum(splits[: e + 1]), (e, lo, end)
        for r in range(lo, hi):
            assert owner[r] == e
            seen[r] += 1
    assert seen == [1] * len(owner)


@pytest.mark.parametrize("splits", [[8] * 4, [0, 9, 7], [70, 0, 130], [128] * 3, [2048, 1], [0, 0]])
def test_pick_block_m_is_a_kernel_tile_at_or_above_the_mean_expert(splits):
    """With 256 columns the rows per tile are one of the kernel's compiled choices, at least the mean rows of the
    non-empty experts (or the largest choice), and the smallest such choice."""
    choices = tiles.BLOCK_M_CHOICES
    bm = tiles.pick_block_m(splits, 256)
    busy = [m for m in splits if m]
    mean = sum(busy) / len(busy) if busy else max(choices)
    assert bm in choices
    assert bm >= mean or bm == max(choices)
    assert all(b < mean for b in choices if b < bm)


@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize("splits", [[8] * 4, [0, 9, 7], [128] * 3, [129, 0, 200], [2048, 1], [600] * 4, [0, 0]])
def test_rows_per_tile_follow_the_column_width(splits, block_n):
    """The register kernel takes 256 rows per tile only with 128-column tiles (the same 128 accumulator registers
    per thread as 128 x 128), and picks it there when the non-empty experts' mean rows exceed 128; otherwise it picks
    as with 256 columns."""
    assert tiles.block_m_choices(256) == tiles.BLOCK_M_CHOICES and tiles.block_m_choices(128)[-1] == 256
    bm = tiles.pick_block_m(splits, block_n)
    busy = [m for m in splits if m]
    mean = sum(busy) / len(busy) if busy else 0
    assert bm in tiles.block_m_choices(block_n)
    if block_n == 128 and mean > 128:
        assert bm == 256
    else:
        assert bm == tiles.pick_block_m(splits, 256)
    # its own column pick: 128 columns x 256 rows above 128 mean rows, else 256 columns
    assert tiles.pick_block_n(splits) == (128 if mean > 128 else 256)


def test_programs_one_per_tile_or_a_capped_persistent_count():
    """One program per work item by default; a persistent count never exceeds the work items; a count below 1 is
    refused naming the argument (``True``, one per SM, needs a GPU and runs in the GPU test)."""
    assert tiles.programs(86016, False, "cpu") == 86016
    assert tiles.programs(126, 3, "cpu") == 3
    assert tiles.programs(6, 132, "cpu") == 6
    with pytest.raises(ValueError, match="persistent must be a bool or a positive number of programs, got 0"):
        tiles.programs(6, 0, "cpu")


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_n=192), r"block_n must be one of \(128, 256\), got 192"),
        (dict(block_n=64), r"block_n must be one of \(128, 256\), got 64"),
        (dict(block_n=256, block_m=48), r"block_m must be one of \(8, 16, 32, 64, 128\), got 48"),
        (dict(block_n=256, block_m=256), r"block_m must be one of \(8, 16, 32, 64, 128\), got 256"),
        (dict(load_stages=9), "load_stages must be 2 to 8, got 9"),
        (dict(decode_ahead=True, block_n=256), r"decode_ahead runs on 128-column tiles .* got block_n 256"),
    ],
)
def test_bad_tile_arguments_are_refused_before_any_launch(op, kw, match):
    """A tile option the kernel has no compiled form for is refused with the entry point and the argument's name,
    on any device: the checks run before a descriptor or a launch (256 rows per tile only with 128 columns; decode
    ahead only on 128-column tiles, where two fragments fit the registers)."""
    from kimi_core.kernels.w4a16 import gluon

    _needs_gluon()
    wp, ws = random_packed(MXFP4, 2, 256, 512)
    if op == "fwd":
        fn, a, name = gluon.grouped_gemm, torch.zeros(16, 512, dtype=torch.bfloat16), "grouped_gemm"
    else:
        fn, a, name = gluon.grouped_gemm_dgrad, torch.zeros(16, 256, dtype=torch.bfloat16), "grouped_gemm_dgrad"
    with pytest.raises(ValueError, match=rf"w4a16.gluon.{name}: " + match):
        fn(a, wp, ws, MXFP4, [8, 8], **kw)


@pytest.mark.parametrize("fmt,K", [(MXFP4, 384), (MXFP4, 768), ("pack-quantized", 384), (MXFP4, 1024)])
def test_forward_scales_rows_are_16_bytes_and_kept_per_weight_version(fmt, K):
    """The forward's scale rows as TMA gets them: where ``K / 32`` scales are no multiple of 16 bytes a padded copy
    (zeros past the scales, the scales unchanged), made once per weight and again after an in-place write; else a
    view of the weight itself."""
    from kimi_core.kernels.w4a16.gluon.launch import forward_scales

    _, ws = random_packed(fmt, 3, 16, K)
    rows = forward_scales(ws)
    assert rows.shape == (48, K // 32) and rows.stride(0) * rows.element_size() % 16 == 0
    assert torch.equal(rows, ws.reshape(48, K // 32))
    if (K // 32 * ws.element_size()) % 16 == 0:
        assert rows.data_ptr() == ws.data_ptr()
        return
    assert forward_scales(ws) is rows  # kept
    full = rows.as_strided((48, rows.stride(0)), (rows.stride(0), 1))
    assert not full[:, K // 32 :].any()
    ws.add_(1)  # a new version of the weight
    again = forward_scales(ws)
    assert again is not rows and torch.equal(again, ws.reshape(48, K // 32))


# run as a child process: TRITON_INTERPRET must be set before triton is imported
_DEVICE_TILES_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from kimi_core.kernels.w4a16.gluon.device_tiles import device_tile_table, most_tiles

g = torch.Generator().manual_seed(0)
for E, block in ((5, 8), (37, 64), (100, 256), (3, 16), (4, 128)):
    s = torch.randint(0, 300, (E,), generator=g)
    s[::4] = 0
    if E == 4:
        s[:] = 0  # every expert empty
    T = int(s.sum())
    table, count = device_tile_table(s, block, T, "cpu")
    assert table.shape == (most_tiles(T, E, block), 3) and table.dtype == torch.int32 and count.dtype == torch.int32
    want, start = [], 0  # the loop over each expert's rows in block steps
    for e, m in enumerate(s.tolist()):
        want += [[e, r, start + m] for r in range(start, start + m, block)]
        start += m
    n = int(count)
    assert n == len(want) and table[:n].tolist() == want, (E, block)
    assert not table[n:].any(), (E, block)
print("OK")
"""


def test_device_tile_table_in_interpreter():
    """The tile table built on the GPU from device splits (:mod:`.gluon.device_tiles`, here in Triton's interpreter):
    its first ``count`` rows equal the loop over each expert's rows in ``block_m`` steps, the rest are zeros, in a
    table sized for the most tiles any split of ``T`` rows can have (every expert empty included)."""
    pytest.importorskip("triton")
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _DEVICE_TILES_SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=root
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
