"""``kimi_core.kernels.transpose``: the tiled transpose the register dgrad runs on every call's group scales.
Oracle: torch's own strided copy (``src.transpose(1, 2)``), element for element. On the CPU under Triton's
interpreter (sizes that leave partial tiles on both axes, a padded destination, uint8 and bf16); on the GPU
(``-m gpu``) at K3 fc1's real scale table and with odd sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# run as a child process: TRITON_INTERPRET must be set before triton is imported
_INTERP_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from kimi_core.kernels.transpose import transpose_last_two

g = torch.Generator().manual_seed(0)
for dtype in (torch.uint8, torch.bfloat16):
    for B, R, C, pad in ((3, 70, 5, 0), (2, 65, 130, 11), (1, 1, 1, 0)):
        if dtype == torch.uint8:
            src = torch.randint(0, 256, (B, R, C), dtype=torch.uint8, generator=g)
        else:
            src = torch.randn(B, R, C, generator=g).to(torch.bfloat16)
        dst = torch.full((B * C, R + pad), 7, dtype=dtype)[:, :R].view(B, C, R)
        transpose_last_two(src, dst)
        assert torch.equal(dst, src.transpose(1, 2)), (dtype, B, R, C, pad)
        if pad:  # the padding columns are not written
            base = dst.as_strided((B * C, R + pad), (R + pad, 1))
            assert bool((base[:, R:] == 7).all()), (dtype, B, R, C, pad)
print("OK")
"""


def test_transpose_matches_torch_in_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    res = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root),
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_transpose_refuses_mismatched_destination():
    pytest.importorskip("triton")
    from kimi_core.kernels.transpose import transpose_last_two

    src = torch.zeros(2, 4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"src \(2, 4, 3\).*dst \(2, 4, 3\)"):
        transpose_last_two(src, torch.zeros(2, 4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        transpose_last_two(src, torch.zeros(2, 3, 4, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("B,R,C,pad", [(112, 6144, 112, 0), (24, 7168, 64, 0), (5, 4100, 33, 4), (1, 63, 1, 1)])
def test_transpose_matches_torch_on_gpu(dtype, B, R, C, pad):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kimi_core.kernels.transpose import transpose_last_two

    if dtype == torch.uint8:
        src = torch.randint(0, 256, (B, R, C), dtype=torch.uint8, device="cuda")
    else:
        src = torch.randn(B, R, C, device="cuda").to(torch.bfloat16)
    dst = torch.empty((B * C, R + pad), dtype=dtype, device="cuda")[:, :R].view(B, C, R)
    transpose_last_two(src, dst)
    assert torch.equal(dst, src.transpose(1, 2))
