"""The Gluon W4A16 backend (Hopper): the weights decoded into the wgmma's register fragment, forward and dgrad.

* :mod:`.tiles`: tile sizes and picks, the tile table, the shapes it takes (host only);
* :mod:`.pipeline`: the Gluon building blocks (decode, scale boxes, TMA loader, rings, epilogue);
* :mod:`.register_kernel`: the kernel;
* :mod:`.launch`: :func:`grouped_gemm` / :func:`grouped_gemm_dgrad`.

Needs Triton with Gluon (:data:`HAVE_GLUON`); the dispatcher asks :func:`shape_fits` before picking it.
"""

from kimi_core.kernels.w4a16.gluon.launch import grouped_gemm, grouped_gemm_dgrad
from kimi_core.kernels.w4a16.gluon.pipeline import HAVE_GLUON
from kimi_core.kernels.w4a16.gluon.tiles import shape_fits

__all__ = ["HAVE_GLUON", "grouped_gemm", "grouped_gemm_dgrad", "shape_fits"]
