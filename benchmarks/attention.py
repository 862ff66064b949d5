"""Memory and time of the trainer's causal attention (``kimi_core.attention.causal_attention``), forward + backward,
at growing sequence lengths: peak memory above the inputs must grow linearly with the tokens (no S x S tensor).

    python benchmarks/attention.py [--lengths 4096,16384,32768,65536] [--heads 64] [--json out.json]

Shapes are MLA's (qk head dim 192 = 128 nope + 64 rope, v head dim 128), bf16, one packed-free sequence. On CUDA
this times the fused SDPA path; on a CPU the blockwise kernel (use small lengths). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch
from provenance import markdown_table, stamp, write_json

from kimi_core.attention import causal_attention, uses_fused_attention


def run_length(S: int, heads: int, device: str, dtype: torch.dtype) -> dict:
    """One length: the second of two forward + backward calls, timed; peak memory above q, k, v and their grads."""

    def make(d: int) -> torch.Tensor:
        return torch.randn(1, heads, S, d, device=device, dtype=dtype, requires_grad=True)

    q, k, v = make(192), make(192), make(128)
    path = "fused SDPA" if uses_fused_attention(q) else "blockwise"
    cuda = device == "cuda"
    for _ in range(2):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        causal_attention(q, k, v, 192**-0.5).float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        q.grad = k.grad = v.grad = None
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return {"tokens": S, "heads": heads, "path": path, "fwd_bwd_ms": ms, "peak_above_inputs_gib": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384,32768,65536", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=64, help="attention heads (K2: 64, K3: 96)")
    p.add_argument("--json", help="write the rows and the run's provenance here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [run_length(int(s), args.heads, device, torch.bfloat16) for s in args.lengths.split(",")]
    print(
        markdown_table(
            ["tokens", "heads", "path", "fwd+bwd ms", "peak above inputs GiB", "GiB per 1k tokens"],
            [
                [
                    r["tokens"],
                    r["heads"],
                    r["path"],
                    f"{r['fwd_bwd_ms']:.1f}",
                    f"{r['peak_above_inputs_gib']:.2f}",
                    f"{r['peak_above_inputs_gib'] / r['tokens'] * 1024:.3f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, {**stamp("attention.py"), "rows": rows})


if __name__ == "__main__":
    main()
