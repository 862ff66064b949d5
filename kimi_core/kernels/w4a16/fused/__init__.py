"""The fused Triton W4A16 backend: the 4-bit weights decoded in registers and fed straight to the tensor cores.

* :mod:`.decode`: the exact bf16 decode of MXFP4 / INT4 codes (jit helpers);
* :mod:`.tiles`: the tile schedule over the experts' rows;
* :mod:`.forward`, :mod:`.dgrad`: the kernels;
* :mod:`.plans`: the launch plans (data);
* :mod:`.launch`: :func:`grouped_gemm` / :func:`grouped_gemm_dgrad`, arguments as the public ops (validated there).
"""

from kimi_core.kernels.w4a16.fused.launch import grouped_gemm, grouped_gemm_dgrad
from kimi_core.kernels.w4a16.fused.plans import dgrad_config, fwd_config

__all__ = ["dgrad_config", "fwd_config", "grouped_gemm", "grouped_gemm_dgrad"]
