"""Context and sequence parallelism: CP = 2 (two gloo processes, megatron's load-balanced split), TP = 2 with
``--sequence-parallel``, and TP = 2 x CP = 2 with and without it (four processes) give the single-rank logits and
gradients of the tiny K2 (RoPE/YaRN MLA), K3 (KDA + gated NoPE MLA + attention-residual bank + latent MoE) and K3.1
(+ DSA indexer and sparse attention), unpacked (with R3 routing replay) and packed (THD), fp32: every parameter's
gradient and those of a random LoRA adapter on top, reduced as megatron's training step reduces them."""

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
    """``{family: {"cp1": ..., "cp2": ..., "tp2sp": ...}}`` of the 2-layer tiny ``family``. All three families run
    in one 2-process spawn (one start and megatron import per rank instead of one per family); each layout still
    builds its own groups and model (``cp_worker.one_layout``)."""
    jobs = [(f, tiny_ckpt(f, layers=2), name) for f in FAMILIES for name in ("cp1", "cp2", "tp2sp")]
    return cp_worker.spawn_jobs(jobs, str(tmp_path_factory.mktemp("cp") / "cp.pt"))


@pytest.fixture(scope="module")
def runs4(tiny_ckpt, tmp_path_factory):
    """The four-process layouts in one spawn: TP 2 x CP 2 on K3.1, TP 2 x CP 2 with sequence parallelism on every
    family."""
    jobs = [("k31", tiny_ckpt("k31", layers=2), "tp2cp2")]
    jobs += [(f, tiny_ckpt(f, layers=2), "tp2spcp2") for f in FAMILIES]
    return cp_worker.spawn_jobs(jobs, str(tmp_path_factory.mktemp("cp4") / "cp4.pt"), world=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_equals_cp1(family, runs):
    """2 layers (K3/K3.1: a KDA layer then an MLA layer; the MoE layer has 16 experts): every CP = 2 rank holds its
    two chunks of each sequence, and the reassembled logits (1e-5) and the CP-summed gradients of every parameter
    (1e-4, relative RMS) equal one rank holding everything."""
    _compare(runs[family], "cp1", "cp2")


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sequence_parallel_equals_single_rank(family, runs):
    """TP = 2 with ``--sequence-parallel`` (each rank holds half of the tokens between modules; MLA, KDA, the MLPs and
    the latent MoE projections gather them, the routed experts and R3 replay see the rank's half): logits and every
    gradient after megatron's TP sum of the ``sequence_parallel`` parameters equal one rank holding everything."""
    _compare(runs[family], "cp1", "tp2sp")


def test_tp2_cp2_equals_single_rank(runs, runs4):
    """TP = 2 x CP = 2 (four gloo processes) on the tiny K3.1 (KDA, gated NoPE MLA, indexer, MoE): logits and every
    gradient equal one rank holding everything (the CP = 1 run of the test above), unpacked and packed."""
    _compare({**runs["k31"], **runs4["k31"]}, "cp1", "tp2cp2")


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sequence_parallel_cp2_equals_single_rank(family, runs, runs4):
    """TP = 2 + sequence parallel x CP = 2 (four gloo processes; each rank holds a quarter of every sequence between
    modules): logits and every gradient equal one rank holding everything, unpacked and packed."""
    _compare({**runs[family], **runs4[family]}, "cp1", "tp2spcp2")
