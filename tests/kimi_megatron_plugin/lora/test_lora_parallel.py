"""LoRA-factor gradients under TP=2, PP=2 and EP=2 (2 gloo processes) equal the one-process ones:
shared expert factors summed over EP, per-expert factors local, TP pieces exact."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import lora_mp_worker
from utils import assert_close

pytestmark = pytest.mark.timeout(900)

# Factors whose gradient does not flow back through an MLA input (the last layer, 3, is MLA in the
# tiny 4-layer K3.1): upstream of it TP > 1 gradients have the open k_pe gap (docs/megatron.md).
_TP_EXACT = (
    "language_model.model.layers.3.self_attn.o_proj",
    "language_model.model.layers.3.self_attn.g_proj",
    "language_model.model.layers.3.self_attn.q_b_proj",
    "language_model.model.layers.3.self_attn.kv_b_proj",
    "language_model.model.layers.3.block_sparse_moe.",
)


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory):
    path = tiny_ckpt("k31", layers=4)
    return lora_mp_worker.spawn(path, str(tmp_path_factory.mktemp("lorapar") / "runs.pt"))


def _merged(payloads):
    out = {}
    for p in payloads:
        out.update(p["grads"])
    return out


@pytest.mark.parametrize("layout", ["pp2", "ep2"])
def test_lora_gradients_equal_single_process(runs, layout):
    """PP=2 and EP=2 (+DP 2) give every LoRA factor's one-process gradient (shared-outer experts,
    normalised rank; shared factors all-reduced over EP, per-expert factors local)."""
    base, got = runs["single"][0]["grads"], _merged(runs[layout])
    assert set(base) == set(got)
    for name in base:
        for ab in (0, 1):
            assert_close(f"{layout} lora grad {name} {'AB'[ab]}", base[name][ab], got[name][ab], 1e-4)


def test_tp2_lora_gradients_downstream_of_mla(runs):
    """TP=2 gradients of the LoRA factors not upstream of an MLA input equal the one-process ones."""
    base, got = runs["single"][0]["grads"], _merged(runs["tp2"])
    checked = [n for n in base if n.startswith(_TP_EXACT)]
    assert len(checked) >= 6
    for name in checked:
        for ab in (0, 1):
            assert_close(f"tp2 lora grad {name} {'AB'[ab]}", base[name][ab], got[name][ab], 1e-4)


def test_tp2_lora_gradients_all(runs):
    """Every TP=2 LoRA-factor gradient equals the one-process one (the LoRA delta of kv_a_proj_with_mqa goes
    through KimiMLA's k_pe gradient gather, models.layers.GatherKVLatent)."""
    base, got = runs["single"][0]["grads"], _merged(runs["tp2"])
    assert set(base) == set(got)
    for name in base:
        for ab in (0, 1):
            assert_close(f"tp2 lora grad {name} {'AB'[ab]}", base[name][ab], got[name][ab], 1e-4)
