"""``benchmarks/serving.py``'s arithmetic, engine-free: prefill and decode tokens per second of a config from the
walls of a fake engine whose times are written here, and the ratio table against ``off``."""

from __future__ import annotations

from utils import load_benchmark


class FakeEngine:
    """A :class:`ServingBench` whose ``run`` takes ``0.5 s`` per prompt batch plus ``0.01 s`` per generated step
    beyond the first token (``lora`` adds a tenth), and generates exactly what was asked."""

    def __new__(cls, serving, repeats: int):
        class _Fake(serving.ServingBench):
            def run(self, n, length, new, lora):
                wall = (0.5 + 0.01 * (new - 1)) * (1.1 if lora else 1.0)
                return wall, n * new

        return _Fake(vocab=100, repeats=repeats, deadline=float("inf"))


def test_config_prefill_and_decode_rates_match_hand_computed_values():
    """prefill tok/s = P * S / wall(1 token) and decode tok/s = D * (T - 1) / (wall(T) - wall(1))."""
    serving = load_benchmark("serving")
    bench = FakeEngine(serving, repeats=3)
    sizes = {"prefill": (4, 100), "decode": (8, 16, 11)}
    off = bench.config("off", None, sizes)
    assert off["prefill_tok_s"] == 4 * 100 / 0.5  # 800
    assert abs(off["decode_tok_s"] - 8 * 10 / 0.1) < 1e-6  # 10 steps of 0.01 s at batch 8: 800 tok/s
    assert abs(off["decode_step_ms"] - 10.0) < 1e-9
    assert off["generated_tokens"] == [8 * 11] * 3 and off["expected_tokens"] == 88
    one = bench.config("one", "adapter", sizes)
    assert abs(one["prefill_tok_s"] - 800 / 1.1) < 1e-6
    table = serving.ratio_table({"configs": [off, one]}, {"one": "1 adapter"})
    lines = table.splitlines()
    assert lines[0].startswith("| config | prefill tok/s | vs off |")
    assert lines[2] == "| off | 800 | 1.000x | 800 | 1.000x | 10.00 |"
    assert lines[3] == "| 1 adapter | 727 | 0.909x | 727 | 0.909x | 11.00 |"


def test_prompt_ids_are_fresh_and_in_range():
    """Every batch draws new ids in ``3 .. vocab-1``, so no prefix cache ever hits."""
    bench = FakeEngine(load_benchmark("serving"), repeats=1)
    a, b = bench.prompt_ids(2, 50), bench.prompt_ids(2, 50)
    assert a != b
    assert all(3 <= t < 100 for ids in a + b for t in ids) and [len(x) for x in a] == [50, 50]
