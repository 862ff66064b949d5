"""Every ``[N, K]`` weight shape a Kimi routed-expert layer hands the W4A16 grouped GEMM: K2.x / K2.5 / K3 / K3.1, fc1
and fc2, at expert tensor parallelism 1, 2, 4 and 8, from the release configs (:mod:`kimi_core.release_configs`).

Per release, with ``d_in`` the width the experts read (K2.x: ``hidden_size`` 7168; K3: the latent
``routed_expert_hidden_size`` 3584) and ``d_ff`` = ``moe_intermediate_size`` (K2.x 2048, K3 3072), expert TP ``t``
splits ``d_ff``:

* ``fc1``: gate and up as one weight, ``[2 d_ff / t, d_in]`` (the fused gate-up layout of the benchmarks);
* ``gate`` (``up`` alike): ``[d_ff / t, d_in]``, the Megatron plugin's separate gate / up calls;
* ``fc2``: down, ``[d_in, d_ff / t]``.

K2.5's text model is K2's (its experts the same shapes). Both formats are listed for every shape: the releases
ship INT4 (K2.x) and MXFP4 (K3), and a conversion may give either.
"""

from __future__ import annotations

import dataclasses

from kimi_core.config import KimiConfig
from kimi_core.release_configs import k2_release_config, k3_release_config, k31_release_config

__all__ = ["EXPERT_TP", "LOCAL_EXPERTS", "ExpertShape", "expert_shapes", "unique_shapes"]

#: the expert tensor-parallel sizes covered
EXPERT_TP = (1, 2, 4, 8)

#: local experts per rank the benchmark runs each family with (K3: 896 experts over 8 EP ranks; K2.x: 384 over 16)
LOCAL_EXPERTS = {"k2": 24, "k25": 24, "k3": 112, "k31": 112}


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """One expert weight ``[N, K]`` (``y [T, N] = x [T, K] . W^T``) of ``family``'s ``proj`` at expert TP ``etp``."""

    family: str
    proj: str  # "fc1", "gate" or "fc2"
    etp: int
    N: int
    K: int

    @property
    def name(self) -> str:
        return f"{self.family.upper()} {self.proj} etp{self.etp}"


def _family_dims() -> dict[str, tuple[int, int]]:
    """``{family: (d_in, d_ff)}`` of the releases."""
    dims = {}
    for make in (k2_release_config, k3_release_config, k31_release_config):
        cfg = KimiConfig.from_hf(make(), "kimi_core.release_configs")
        dims[cfg.family] = (cfg.expert_in_size, cfg.moe_intermediate_size)
    dims["k25"] = dims["k2"]  # K2.5's text model is K2's
    return {f: dims[f] for f in ("k2", "k25", "k3", "k31")}


def expert_shapes() -> list[ExpertShape]:
    """Every (family, projection, expert TP) shape, in family, TP, projection order."""
    out = []
    for family, (d_in, d_ff) in _family_dims().items():
        for etp in EXPERT_TP:
            ff = d_ff // etp
            out += [
                ExpertShape(family, "fc1", etp, 2 * ff, d_in),
                ExpertShape(family, "gate", etp, ff, d_in),
                ExpertShape(family, "fc2", etp, d_in, ff),
            ]
    return out


def unique_shapes() -> list[tuple[int, int, list[str], int]]:
    """``(N, K, names, local experts)`` once per distinct ``(N, K)`` (the first family's experts), with every name
    that has it."""
    seen: dict[tuple[int, int], tuple[list[str], int]] = {}
    for s in expert_shapes():
        names, _ = seen.setdefault((s.N, s.K), ([], LOCAL_EXPERTS[s.family]))
        names.append(s.name)
    return [(N, K, names, e) for (N, K), (names, e) in seen.items()]
