"""Context parallelism: CP = 2 (two gloo processes, megatron's load-balanced split) gives the CP = 1 logits and
gradients of the tiny K2 (RoPE/YaRN MLA), K3 (KDA + gated NoPE MLA + attention-residual bank) and K3.1 (+ DSA
indexer and sparse attention), unpacked and packed (THD), fp32: every parameter's gradient and those of a random LoRA
adapter on top."""

from __future__ import annotations

import cp_worker
import pytest
from utils import assert_close

pytestmark = pytest.mark.timeout(600)


def _compare(res, base: str, got: str):
    for kind in ("unpacked", "packed"):
        ref, out = res[base][kind], res[got][kind]
        assert_close(f"{got} {kind} logits", ref["logits"], out["logits"], 1e-5)
        assert set(ref["grads"]) == set(out["grads"])
        for name in ref["grads"]:
            assert_close(f"{got} {kind} grad {name}", ref["grads"][name], out["grads"][name], 1e-4)
        assert set(ref["lora"]) == set(out["lora"]) and len(ref["lora"]) > 10
        for name in ref["lora"]:
            assert_close(f"{got} {kind} lora grad {name}", ref["lora"][name], out["lora"][name], 1e-4)


FAMILIES = ("k2", "k3", "k31")


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory):
    """``{family: {"cp1": ..., "cp2": ...}}`` of the 2-layer tiny ``family``. All three families run in one
    2-process spawn (one start and megatron import per rank instead of one per family); each layout still builds
    its own groups and model (``cp_worker.one_layout``)."""
    jobs = [(f, tiny_ckpt(f, layers=2), name) for f in FAMILIES for name in ("cp1", "cp2")]
    return cp_worker.spawn_jobs(jobs, str(tmp_path_factory.mktemp("cp") / "cp.pt"))


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_equals_cp1(family, runs):
    """2 layers (K3/K3.1: a KDA layer then an MLA layer; the MoE layer has 16 experts): every CP = 2 rank holds its
    two chunks of each sequence, and the reassembled logits (1e-5) and the CP-summed gradients of every parameter
    (1e-4, relative RMS) equal one rank holding everything."""
    _compare(runs[family], "cp1", "cp2")


def test_tp2_cp2_equals_single_rank(runs, tiny_ckpt, tmp_path):
    """TP = 2 x CP = 2 (four gloo processes) on the tiny K3.1 (KDA, gated NoPE MLA, indexer, MoE): logits and every
    gradient equal one rank holding everything (the CP = 1 run of the test above), unpacked and packed."""
    res = cp_worker.spawn(tiny_ckpt("k31", layers=2), str(tmp_path / "tpcp.pt"), names=("tp2cp2",), world=4)
    _compare({**runs["k31"], **res}, "cp1", "tp2cp2")
