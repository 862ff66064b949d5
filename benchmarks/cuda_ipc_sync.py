"""Adapter-only sync over CUDA IPC (``kimi_rl_glue.sync.CudaIpcAdapterSync``): GB/s and the checksum's share.

The adapter is the rank-32 K3 layer slice of ``benchmarks/lora_bucket_export.py`` (one MLA + latent-MoE
layer, all 896 routed experts, bf16). The trainer (this process, ``cuda:0``) publishes version ``k``;
an engine process on ``--engine-gpu`` (``cuda:1``: another GPU over NVLink; ``cuda:0``: colocated, as
miles runs SGLang) opens the IPC handles, copies every bucket into its own memory with the checksum
fused into the copy, verifies, and acknowledges. Cases: the whole adapter (EP=1) and one consumer
rank of EP=2 (only experts 0..447), shared-outer and per-expert layouts.

Time = publish (flatten by ``torch.cat`` + one block-sums pass per bucket on the trainer GPU; IPC
handles; manifest digest) + receive (open, one kernel per bucket: copy + sums + compare with the
sender's sums; across GPUs a copy over NVLink first; one synchronisation) + the manifest's
trip through a pipe. The checksum's share = (time with sums - time
without) / time with sums, best of ``--repeats`` each. Correctness checks before timing: the
engine's tensors equal the trainer's bytes (SHA-256 over each tensor, on the CPU), the GPU sums
equal the CPU (numpy) ``region_sums``, and one flipped byte in a published bucket is reported
naming the tensor. Appends a table to ``benchmarks/RESULTS.md`` (``--no-append`` to skip).

    python benchmarks/cuda_ipc_sync.py [--engine-gpu 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from lora_bucket_export import LAYER, k3_config, layer_slice  # noqa: E402
from results import append, git_commit, today  # noqa: E402

from kimi_core.lora import Adapter  # noqa: E402
from kimi_core.lora.buckets import region_sums  # noqa: E402
from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync  # noqa: E402
from kimi_rl_glue.sync.disk import AdapterSyncError  # noqa: E402


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def engine(gpu: int, bucket_bytes: int, conn) -> None:
    """Engine side: receive each announced (manifest, version, checksum, want_digests), answer with timings."""
    torch.cuda.set_device(gpu)
    syncs = {c: CudaIpcAdapterSync(gpu, bucket_bytes, checksum=c) for c in (True, False)}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        manifest, version, checksum, want = msg
        t = time.perf_counter()
        try:
            ad = syncs[checksum].receive(manifest, version)
        except AdapterSyncError as e:
            conn.send({"error": str(e)})
            continue
        dt = time.perf_counter() - t
        conn.send({"receive_s": dt, **ad.extra["sync_timings"], "digests": _digests(ad.tensors) if want else None})
        del ad


def _gpu_ms(fn, repeats: int = 5) -> float:
    """Best GPU time of ``fn`` (CUDA events), ms."""
    out = []
    for _ in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return min(out[1:])


def repeat_layers(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The layer slice ``n`` times on ``cuda:0`` as layers ``LAYER .. LAYER + n - 1`` (independent copies)."""
    out = {}
    for i in range(n):
        for k, v in tensors.items():
            out[k.replace(f".layers.{LAYER}.", f".layers.{LAYER + i}.")] = v.cuda(0)  # a fresh copy per layer
    return out


def phase_breakdown(nbytes: int = 512 << 20) -> list[str]:
    """Where a checksum's time goes on one GPU: host block layout, the sums kernel alone, the fused
    copy + sums kernel vs a plain copy, and the whole ``copy_region_sums`` call (layout, kernel, host combine)."""
    from kimi_core.lora.buckets import _block_layout, copy_block_sums, copy_region_sums

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(buf)
    starts = [0, nbytes // 4, nbytes // 2]
    t = time.perf_counter()
    _block_layout(starts, nbytes)
    t_layout = (time.perf_counter() - t) * 1e3
    k_sum = _gpu_ms(lambda: copy_block_sums(buf, None, starts, nbytes))
    k_fused = _gpu_ms(lambda: copy_block_sums(buf, dst, starts, nbytes))
    k_copy = _gpu_ms(lambda: dst.copy_(buf))
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        copy_region_sums(buf, dst, starts, nbytes)
        walls.append((time.perf_counter() - t) * 1e3)
    gb = nbytes / 1e9
    return [f"phase breakdown on {gb:.2f} GB: host layout {t_layout:.2f} ms; sums kernel {k_sum:.3f} ms "
            f"({gb / k_sum * 1e3:.0f} GB/s read); fused copy+sums kernel {k_fused:.3f} ms vs plain copy {k_copy:.3f} ms; "
            f"whole copy_region_sums call {min(walls):.2f} ms (wall)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-gpu", type=int, default=1 if torch.cuda.device_count() > 1 else 0)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1,
                    help="copies of the layer slice under distinct layer names (a larger adapter; 0.54 GB each)")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--section-out", default=None, help="also write the section to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    cfg = k3_config()
    E = cfg.n_routed_experts
    bucket = args.bucket_mib << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(args.engine_gpu, bucket, child), daemon=True)
    proc.start()
    trainer = {c: CudaIpcAdapterSync(0, bucket, checksum=c) for c in (True, False)}
    version = 0

    def one(adapter, checksum: bool, experts, want=False):
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        manifest, pt = trainer[checksum].publish(adapter, version, experts=experts, config=cfg)
        parent.send((manifest, version, checksum, want))
        rt = parent.recv()
        total = time.perf_counter() - t0
        trainer[checksum].release(version)
        if "error" in rt:
            raise AdapterSyncError(rt["error"])
        return total, pt, rt

    rows, checks = [], []
    cases = [("shared_outer", E, None), ("shared_outer", E, (0, E // 2)), ("per_expert", 112, None)]
    for layout, n_exp, experts in cases:
        tensors = repeat_layers(layer_slice(cfg, layout, n_exp), args.layers)
        adapter = Adapter(tensors, {"r": 32}, source="bench")
        # correctness: bytes arrive intact (SHA-256 per tensor, CPU) ...
        _, _, rt = one(adapter, True, experts, want=True)
        from kimi_core.lora import filter_experts

        sent = filter_experts(tensors, cfg, *experts) if experts else tensors
        ok = rt["digests"] == _digests(sent)
        checks.append(f"{layout} E={n_exp} experts={experts}: received bytes == sent (SHA-256 per tensor): {ok}")
        if not ok:
            raise SystemExit("received adapter differs from the sent one")
        for _ in range(2):  # warm-up both paths
            one(adapter, True, experts)
            one(adapter, False, experts)
        best = {}
        for c in (True, False):
            runs = [one(adapter, c, experts) for _ in range(args.repeats)]
            best[c] = min(runs, key=lambda r: r[0])
        (t_on, p_on, r_on), (t_off, _p, _r) = best[True], best[False]
        nbytes = p_on["bytes"]
        rows.append(dict(layout=layout, experts=n_exp, ep=f"{experts[0]}..{experts[1] - 1}" if experts else "all",
                         gb=nbytes / 1e9, buckets=p_on["buckets"], t_on=t_on, t_off=t_off,
                         flatten=p_on["flatten_s"], share=p_on["share_s"], open=r_on["open_s"], copy=r_on["copy_s"],
                         verify=r_on["verify_s"]))
        del tensors, adapter
        torch.cuda.empty_cache()

    # GPU sums equal the numpy implementation; a flipped byte is caught naming the tensor
    small = {k: v.cuda(0) for k, v in layer_slice(cfg, "shared_outer", 8).items()}
    from kimi_core.lora import iter_buckets

    b = next(iter_buckets(small, 64 << 20, device="cuda:0"))
    gpu_sums = [m.sum for m in b.metas]
    cpu_sums = region_sums(b.buffer.cpu(), b.region_starts(), b.nbytes)
    checks.append(f"GPU region sums == numpy region_sums on a {b.nbytes / 1e6:.1f} MB bucket: {gpu_sums == cpu_sums}")
    version += 1
    manifest, _ = trainer[True].publish(Adapter(small, {"r": 32}, source="bench"), version)
    live = trainer[True]._live[version][0]  # the first published bucket
    victim = live.metas[len(live.metas) // 2]
    live.buffer[victim.offset + 3] ^= 0x10  # after the sums: a byte flipped in flight
    torch.cuda.synchronize()
    parent.send((manifest, version, True, False))
    rt = parent.recv()
    caught = "error" in rt and victim.name in rt["error"]
    checks.append(f"flipped byte in {victim.name}: engine error names it: {caught} ({rt.get('error', 'no error')[:160]})")
    parent.send(None)
    proc.join(timeout=60)
    checks += phase_breakdown()

    gpu = torch.cuda.get_device_name(0)
    hdr = ("| layout | experts | consumer rows | GB | buckets | sync s (sums on) | GB/s | sync s (sums off) | "
           "checksum share | flatten+sums s | IPC handles s | open s | copy+sums s | verify s |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['layout']} | {r['experts']} | {r['ep']} | {r['gb']:.3f} | {r['buckets']} | {r['t_on'] * 1e3:.2f} ms | "
        f"{r['gb'] / r['t_on']:.1f} | {r['t_off'] * 1e3:.2f} ms | {(r['t_on'] - r['t_off']) / r['t_on'] * 100:.1f}% | "
        f"{r['flatten'] * 1e3:.2f} ms | {r['share'] * 1e3:.2f} ms | {r['open'] * 1e3:.2f} ms | "
        f"{r['copy'] * 1e3:.2f} ms | {r['verify'] * 1e3:.2f} ms |\n" for r in rows)
    where = "another GPU (NVLink)" if args.engine_gpu != 0 else "the same GPU (colocated)"
    section = (f"\n## CUDA-IPC adapter sync, trainer cuda:0 -> engine cuda:{args.engine_gpu} ({where})\n\n"
               f"- date: {today()}\n- machine: {torch.cuda.device_count()}x {gpu}, torch {torch.__version__}\n"
               f"- commit: {git_commit()}\n- command: `python benchmarks/cuda_ipc_sync.py "
               f"{' '.join(sys.argv[1:])}`\n- adapter: rank-32 K3 layer slice (bf16) x {args.layers} layer(s), bucket {args.bucket_mib} MiB, "
               f"best of {args.repeats}; share = (on - off) / on\n\n{hdr}{body}\n"
               + "".join(f"- {c}\n" for c in checks))
    print(section)
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(section)
    if not args.no_append:
        append(section)


if __name__ == "__main__":
    main()
