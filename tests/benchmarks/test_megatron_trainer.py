"""``benchmarks/megatron_trainer.py multi``'s gate, on payloads written here: relative RMS errors against the one-GPU
run, the fp32 bar (1e-4) as the pass / fail, and the bf16 bar at 3x the one-GPU bf16 run's own error vs fp32
(floor 1e-2)."""

from __future__ import annotations

import torch
from utils import load_benchmark


def _payload(logits, grads, loss=None):
    return {"logits": logits, "grads": grads, "loss": loss}


def test_fp32_gate_and_bf16_bar_from_hand_scaled_tensors():
    """A layout off by a factor (1 + e) has relative error e; fp32 passes at 1e-5 and fails at 2e-4; bf16 is judged
    against 3x the bf16 single run's own error (here 2e-2 -> bar 6e-2)."""
    bench = load_benchmark("megatron_trainer")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, generator=g, dtype=torch.float64)
    w, ab = torch.randn(16, generator=g, dtype=torch.float64), (torch.ones(3, dtype=torch.float64),) * 2

    def run(scale):
        return [_payload(logits * scale, {"w": w * scale, "lora": tuple(t * scale for t in ab)})]

    runs = {
        "fp32": {"single": run(1.0), "tp2": run(1 + 1e-5), "pp2": run(1 + 2e-4)},
        "bf16": {"single": run(1 + 2e-2), "tp2": run((1 + 2e-2) * (1 + 5e-2)), "ep2": run((1 + 2e-2) * 1.1)},
    }
    rows = {(r["dtype"], r["layout"]): r for r in bench.compare(runs, full_grads=True)}
    tp2, pp2 = rows[("fp32", "tp2")], rows[("fp32", "pp2")]
    assert abs(tp2["logits"] - 1e-5) < 1e-12 and abs(tp2["grad_worst"] - 1e-5) < 1e-12 and tp2["ok"]
    assert abs(pp2["grad_median"] - 2e-4) < 1e-12 and not pp2["ok"]
    assert tp2["n"] == 3 and tp2["missing"] == 0  # w, lora.A, lora.B
    b_tp2, b_ep2 = rows[("bf16", "tp2")], rows[("bf16", "ep2")]
    assert abs(b_tp2["bar_logits"] - 3 * 2e-2) < 1e-12 and abs(b_tp2["noise"]["grad"] - 2e-2) < 1e-12
    assert b_tp2["within_bar"] and b_tp2["ok"]  # 5e-2 <= 6e-2
    assert not b_ep2["within_bar"] and b_ep2["ok"]  # 1e-1 > 6e-2: reported, not failed
    assert bench._verdict(b_ep2) == "above bar (reported)" and bench._verdict(pp2) == "FAIL"


def test_missing_gradient_fails_the_layout():
    """A layout that returns fewer gradient tensors than the one-GPU run fails, whatever the errors."""
    bench = load_benchmark("megatron_trainer")
    x = torch.ones(2, 2)
    runs = {"fp32": {"single": [_payload(x, {"a": x, "b": x})], "tp2": [_payload(x, {"a": x})]}}
    (row,) = bench.compare(runs, full_grads=True)
    assert row["missing"] == 1 and not row["ok"]
