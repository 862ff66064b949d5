"""CPU adapter sync over shared memory (``kimi_rl_glue.sync.ShmAdapterSync``): GB/s and the checksum's share.

The adapter is the rank-32 K3 layer slice of ``benchmarks/lora_bucket_export.py`` (one MLA + latent-MoE
layer, ``--experts`` routed experts, bf16, per-expert layout). The trainer side (this process)
publishes version ``k``; a spawned engine-side process receives it (copy out of shared memory,
verify every bucket, unlink). Transfer time = publish + receive. The checksum's cost = the sender's
sums (flatten with checksums minus flatten without, measured separately) + the receiver's verify.
Appends a table to ``benchmarks/RESULTS.md`` (``--no-append`` to skip).

    python benchmarks/adapter_sync.py [--experts 112] [--bucket-mib 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from results import append, best, cpu_section, git_commit  # noqa: E402

from kimi_core.lora import Adapter, iter_buckets  # noqa: E402
from kimi_rl_glue.sync import ShmAdapterSync  # noqa: E402
from lora_bucket_export import LAYER, k3_config, layer_slice  # noqa: E402


def engine(channel: str, bucket_bytes: int, conn) -> None:
    """Engine side: receive each announced version, answer with its timings."""
    sync = ShmAdapterSync(channel, bucket_bytes)
    while True:
        version = conn.recv()
        if version is None:
            return
        t = time.perf_counter()
        ad = sync.receive(version)
        conn.send({"receive_s": time.perf_counter() - t, **ad.extra["sync_timings"]})


STAGING = torch.empty(0, dtype=torch.uint8)  # replaced by a bucket-sized one on first use, as in the transport


def flatten(tensors, bucket_bytes: int, checksum: bool) -> None:
    for _ in iter_buckets(tensors, bucket_bytes, checksum=checksum, staging=STAGING):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=112)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    bucket_bytes = args.bucket_mib << 20
    tensors = layer_slice(k3_config(), "per_expert", args.experts)
    adapter = Adapter(tensors, {"peft_type": "LORA", "r": 32, "lora_alpha": 32, "target_modules": "all-linear"})
    nbytes = adapter.nbytes

    sync = ShmAdapterSync(bucket_bytes=bucket_bytes)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=engine, args=(sync.channel, bucket_bytes, child))
    proc.start()
    runs = []
    try:
        for version in range(args.repeats + 1):  # version 0 warms up
            _, pub = sync.publish(adapter, version)
            parent.send(version)
            rec = parent.recv()
            runs.append((pub, rec))
    finally:
        parent.send(None)
        proc.join(60)
    runs = runs[1:]
    pub, rec = min(runs, key=lambda r: r[0]["publish_s"] + r[1]["receive_s"])
    total = pub["publish_s"] + rec["receive_s"]
    global STAGING
    STAGING = torch.empty(bucket_bytes, dtype=torch.uint8)
    t_on = best(lambda: flatten(tensors, bucket_bytes, True), args.repeats)
    t_off = best(lambda: flatten(tensors, bucket_bytes, False), args.repeats)
    send_sum = max(0.0, t_on - t_off)
    check = send_sum + rec["verify_s"]
    flat = next(iter_buckets(tensors, bucket_bytes)).buffer
    sha_gbs = flat.numel() / best(lambda: hashlib.sha256(flat.numpy()).digest(), 1) / 1e9
    gb = nbytes / 1e9
    head = ("| tensors | MB | buckets | transfer GB/s (publish + receive) | publish GB/s | receive GB/s "
            "| sender checksum s | receiver verify s | checksum share of transfer | SHA-256 both sides would be |")
    lines = [head, "|" + " --- |" * 10,
             f"| {len(tensors)} | {nbytes / 1e6:.0f} | {pub['buckets']} | {gb / total:.2f} | "
             f"{gb / pub['publish_s']:.2f} | {gb / rec['receive_s']:.2f} | {send_sum:.3f} | {rec['verify_s']:.3f} | "
             f"{100 * check / total:.0f}% | {100 * 2 * gb / sha_gbs / (total - check + 2 * gb / sha_gbs):.0f}% |",
             "",
             f"Best of {args.repeats} versions after one warm-up; receiver in a spawned process. Publish = flatten "
             f"(+ sums) into a persistent staging buffer and copy into a fresh segment per bucket "
             f"({pub['flatten_s']:.3f} s + "
             f"{pub['copy_s']:.3f} s); receive = copy out ({rec['copy_s']:.3f} s) + verify + unlink. SHA-256 on this "
             f"machine: {sha_gbs:.2f} GB/s."]
    table = "\n".join(lines)
    print(table)
    if args.no_append:
        return
    commit = git_commit((":/kimi_rl_glue/sync", ":/kimi_core/lora"), "kimi_rl_glue/sync")
    section = cpu_section(f"Adapter sync over shared memory (CPU stand-in for CUDA-IPC), rank 32, K3 layer {LAYER} slice "
                          f"with {args.experts} experts, {args.bucket_mib} MiB buckets", commit, "adapter_sync.py", table)
    append(section)
    print("appended to benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
