"""What the serving benchmarks measure, engine-agnostic: fresh random prompts, warm-up, median of repeats, and
prefill / decode tokens per second (``benchmarks/vllm_serving.py``, ``benchmarks/sglang_serving.py``).

- prefill tok/s: ``P`` prompts of ``S`` tokens, 1 new token each: ``P * S / wall``.
- decode tok/s: ``D`` prompts of ``s`` tokens generating ``T`` tokens (EOS ignored), and the same prompt shape
  with 1 new token: ``D * (T - 1) / (wall(T) - wall(1))``, the tokens after the first over the time beyond prefill.
- every run draws fresh prompt ids (3 .. vocab-1), so no prefix cache ever hits; one untimed warm-up of each
  batch shape first; at least one timed repeat, fewer than ``repeats`` once past the deadline.
"""

from __future__ import annotations

import random
import statistics
import time


#: the log prefix (each benchmark script sets its name) and the clock its elapsed seconds count from
TAG = "bench"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{TAG} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class ServingBench:
    """One engine's timed calls; subclasses implement :meth:`run`."""

    def __init__(self, vocab: int, repeats: int, deadline: float, seed: int = 0):
        self.vocab, self.repeats, self.deadline = vocab, repeats, deadline
        self.rng = random.Random(seed)

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def prompt_ids(self, n: int, length: int) -> list[list[int]]:
        """``n`` fresh prompts of ``length`` token ids."""
        return [[self.rng.randrange(3, self.vocab) for _ in range(length)] for _ in range(n)]

    def run(self, n: int, length: int, new: int, lora) -> tuple[float, int]:
        """One batch of ``n`` x ``length`` prompts, ``new`` tokens each, on ``lora`` (engine-specific; a list:
        request ``i`` on ``lora[i % len]``); returns ``(wall s, tokens generated)``."""
        raise NotImplementedError

    def config(self, name: str, lora, sizes: dict) -> dict:
        """Prefill and decode tok/s of one config; ``sizes = {"prefill": (P, S), "decode": (D, s, T)}``."""
        (P, S), (D, s, T) = sizes["prefill"], sizes["decode"]
        for args in ((P, S, 1), (D, s, 1), (D, s, min(T, 16))):  # batch shapes, graphs and kernels, not length
            self.run(*args, lora)
        pre, dec1, decT, gen = [], [], [], []
        for i in range(self.repeats):
            if i and self.out_of_time():
                log(f"{name}: past the time budget after {i} repeat(s)")
                break
            pre.append(self.run(P, S, 1, lora)[0])
            dec1.append(self.run(D, s, 1, lora)[0])
            t, g = self.run(D, s, T, lora)
            decT.append(t)
            gen.append(g)
        p, d1, dT = (statistics.median(x) for x in (pre, dec1, decT))
        row = {"config": name, "prefill_tok_s": P * S / p, "decode_tok_s": D * (T - 1) / max(dT - d1, 1e-9),
               "prefill_s": pre, "decode_prefill_only_s": dec1, "decode_s": decT, "generated_tokens": gen,
               "expected_tokens": D * T, "decode_step_ms": (dT - d1) / (T - 1) * 1e3}
        if any(g != D * T for g in gen):
            log(f"WARNING {name}: generated {gen} tokens, expected {D * T} per run (EOS ignored)")
        log(f"{name}: prefill {row['prefill_tok_s']:.0f} tok/s, decode {row['decode_tok_s']:.0f} tok/s "
            f"({row['decode_step_ms']:.2f} ms/step at batch {D})")
        return row
