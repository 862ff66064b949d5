"""W4A16 grouped GEMM over 4-bit experts (MXFP4 / INT4): bf16 activations times weights kept in their on-disk
layout, forward and dgrad, with autograd to the activations.

* :mod:`.grouped_gemm`: the public ops, validated once, each asking :mod:`.dispatch` for a backend.
* :mod:`.naive`: the pure-torch twin (same signature and return), the oracle of every backend and the CPU path.
* :mod:`.dispatch`: the dispatch tables (data) and :func:`choose_path`, a rule over the kernels' shape constraints;
  :mod:`.expert_shapes`: every Kimi expert shape it must serve (releases x projections x expert TP).
* :mod:`.operands`: the checks at the boundary; host ``m_splits`` read once per call into a
  :class:`~kimi_core.kernels.host_ints.SplitPattern` whose device tables are kept per pattern; :mod:`.derived`: the
  operands derived from a frozen weight (repacked scales, TMA descriptors), kept per weight version.
* Backends: :mod:`.fused` (Triton, decoded in registers), :mod:`.chunked` (decoded into a bounded bf16 workspace,
  then ``torch._grouped_mm``; its Triton decode is :mod:`.dequant_experts`), :mod:`.gluon` (Hopper, decoded into
  the wgmma's register fragment).
"""

# only the public ops: the backends' own names stay in their modules, so they can change without breaking callers
from kimi_core.kernels.w4a16.dispatch import (
    FUSED_OPTIONS,
    GLUON_OPTIONS,
    PATH_ENV,
    PATHS,
    W4A16_CROSSOVER,
    W4A16_GLUON,
    choose_path,
)
from kimi_core.kernels.w4a16.grouped_gemm import (
    W4A16GroupedGemm,
    run_gluon,
    w4a16_grouped_gemm,
    w4a16_grouped_gemm_dgrad,
    w4a16_grouped_linear,
)

__all__ = [
    "FUSED_OPTIONS",
    "GLUON_OPTIONS",
    "PATHS",
    "PATH_ENV",
    "W4A16GroupedGemm",
    "W4A16_CROSSOVER",
    "W4A16_GLUON",
    "choose_path",
    "run_gluon",
    "w4a16_grouped_gemm",
    "w4a16_grouped_gemm_dgrad",
    "w4a16_grouped_linear",
]
