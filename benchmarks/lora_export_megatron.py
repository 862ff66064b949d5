"""CPU baseline of the Megatron trainer's adapter export: GB/s from the live LoRA factors to
verified buckets (``kimi_megatron_plugin.lora``: gather -> PEFT layout -> validate -> checked buckets).

A K2-shaped model scaled down to fit a CPU run (``--hidden`` 1024, ``--experts`` 64 routed experts of
width ``--inter`` 512, ``--layers`` 4, rank ``--rank`` 32, bf16 export) is built with megatron-core
0.16.1 on gloo (world size 1; base weights are not loaded: only the LoRA factors are exported). For
each layout it times: the whole export (``iter_export_buckets``: fp32 factors -> bf16 PEFT tensors ->
``load_adapter`` validation -> flatten + checksums), the factor gather + layout step alone, the
buckets alone, and receiver-side verification; GB/s counts adapter bytes. Appends a table to
``benchmarks/RESULTS.md`` (``--no-append`` to skip).

    python benchmarks/lora_export_megatron.py [--experts 64] [--bucket-mib 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from results import append, best, cpu_section, git_commit  # noqa: E402


def config(args):
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.config import KimiConfig

    d = tiny_config("k2", layers=args.layers)
    d.update(hidden_size=args.hidden, n_routed_experts=args.experts, moe_intermediate_size=args.inter,
             intermediate_size=4 * args.inter, num_experts_per_tok=8)
    return KimiConfig.from_hf(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()

    from kimi_core.lora import Bucket, LoraSpec, iter_buckets
    from kimi_megatron_plugin import cpu_compat, provider
    from kimi_megatron_plugin.lora import apply_lora, export_adapter, iter_export_buckets

    cpu_compat.initialize_cpu_parallel(1, 1, 1, rank=0, world_size=1, port=29000 + os.getpid() % 1000)
    kimi = config(args)
    model = provider.build_model(kimi, provider.transformer_config(kimi, perform_initialization=False))
    bucket_bytes = args.bucket_mib << 20
    rows = []
    for layout in ("per_expert", "shared_outer"):
        lora = apply_lora(model, LoraSpec(rank=args.rank, alpha=args.rank, expert_layout=layout))
        with torch.no_grad():
            for p in lora.parameters():
                p.normal_()
        staging = torch.zeros(bucket_bytes, dtype=torch.uint8)
        ad = export_adapter(lora, layout=layout)
        nbytes = ad.nbytes

        def whole():
            for _b in iter_export_buckets(lora, bucket_bytes, layout=layout, max_rank=args.rank, staging=staging):
                pass

        def buckets_only():
            for _b in iter_buckets(ad.tensors, bucket_bytes, staging=staging):
                pass

        t_all = best(whole, args.repeats)
        t_gather = best(lambda: export_adapter(lora, layout=layout), args.repeats)
        t_buck = best(buckets_only, args.repeats)
        bl = list(iter_buckets(ad.tensors, bucket_bytes))
        t_ver = best(lambda: [Bucket.from_parts(b.buffer, b.metadata()) for b in bl], args.repeats)
        rows.append((layout, len(ad.tensors), nbytes, len(bl), nbytes / t_all / 1e9, nbytes / t_gather / 1e9,
                     nbytes / t_buck / 1e9, nbytes / t_ver / 1e9))
        lora.remove()
        del bl
    head = ("| layout | tensors | MB | buckets | whole export GB/s (gather + layout + validate + buckets) "
            "| gather + layout GB/s | buckets GB/s (flatten + checksums) | receiver verify GB/s |")
    lines = [head, "|" + " --- |" * 8]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2] / 1e6:.0f} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} |")
    table = "\n".join(lines)
    print(table)
    cpu_compat.destroy_cpu_parallel()
    if args.no_append:
        return
    commit = git_commit(("kimi_megatron_plugin",), "kimi_megatron_plugin")
    body = (f"{table}\n\nSource factors are the trainer's fp32 parameters; "
            "the export casts to bf16 (GB/s counts the bf16 adapter bytes).")
    path = append(cpu_section(f"Megatron trainer LoRA export (CPU), rank {args.rank}, K2-shaped hidden {args.hidden}, "
                              f"{args.experts} experts x {args.inter}, {args.layers} layers, {args.bucket_mib} MiB buckets",
                              commit, "lora_export_megatron.py", body,
                              machine_extra=", megatron-core 0.16.1, gloo, world 1"))
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
