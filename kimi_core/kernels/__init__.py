"""GPU kernels of kimi_core, one op per module or folder, each beside its pure-torch twin.

* :mod:`.w4a16`: the W4A16 grouped GEMM over 4-bit experts (MXFP4 / INT4), forward, dgrad and autograd.
* :mod:`.bf16_grouped`: the same grouped linear over bf16 experts (``torch._grouped_mm``), the BF16 baseline.
* :mod:`.fake_quant`: straight-through fake INT4 / MXFP4 of master weights (QAT).
* :mod:`.transpose`: a tiled transpose of the last two axes (the Gluon dgrad's group scales).
* :mod:`.block_sums`: block checksums of adapter buckets.

This module only re-exports the public names, so callers keep importing them from here while the folders change.
"""

from kimi_core.kernels.fake_quant import fake_int4_gpu, fake_mxfp4_gpu, fake_quant_gpu
from kimi_core.kernels.w4a16 import (
    FUSED_OPTIONS,
    GLUON_OPTIONS,
    PATH_ENV,
    PATHS,
    W4A16_CROSSOVER,
    W4A16_GLUON,
    W4A16GroupedGemm,
    choose_path,
    run_gluon,
    w4a16_grouped_gemm,
    w4a16_grouped_gemm_dgrad,
    w4a16_grouped_linear,
)
from kimi_core.quant.formats import INT4, MXFP4

#: the config strings of the two expert formats (read from :mod:`kimi_core.quant.formats`)
MXFP4_FORMAT = MXFP4.name
INT4_FORMAT = INT4.name

__all__ = [
    "FUSED_OPTIONS",
    "GLUON_OPTIONS",
    "INT4_FORMAT",
    "MXFP4_FORMAT",
    "PATHS",
    "PATH_ENV",
    "W4A16GroupedGemm",
    "W4A16_CROSSOVER",
    "W4A16_GLUON",
    "choose_path",
    "fake_int4_gpu",
    "fake_mxfp4_gpu",
    "fake_quant_gpu",
    "run_gluon",
    "w4a16_grouped_gemm",
    "w4a16_grouped_gemm_dgrad",
    "w4a16_grouped_linear",
]
