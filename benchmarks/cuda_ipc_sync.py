"""Adapter-only sync over CUDA IPC (``kimi_rl_glue.sync.CudaIpcAdapterSync``): GB/s and the checksum's share.

The adapter is the rank-32 K3 layer slice of ``benchmarks/lora_bucket_export.py`` (one MLA + latent-MoE
layer, all 896 routed experts, bf16). The trainer (this process, ``cuda:0``) publishes version ``k``;
an engine process on ``--engine-gpu`` (``cuda:1``: another GPU over NVLink; ``cuda:0``: colocated, as
miles runs SGLang) opens the IPC handles, copies every bucket into its own memory with the checksum
fused into the copy, verifies, and acknowledges. Cases: the whole adapter (EP=1) and one consumer
rank of EP=2 (only experts 0..447), shared-outer and per-expert layouts.

Time = publish (one gather kernel per bucket flattens it and writes its block sums on the trainer
GPU; IPC handles; manifest CRC-32) + receive (open; colocated one kernel launch for the whole
version: copy + sums + compare with the sender's sums; across GPUs the copy engine moves bucket
i+1 over NVLink while the SMs check bucket i; one synchronisation) + the manifest's trip through a
pipe. With sums off the same kernels only copy (across GPUs: the copy engine alone). The check's cost is the GPU
time it adds on both sides (CUDA events, on - off) plus the manifest's CRC-32; its share is that
over the sync time without it (the seed's target: <= 2%). Correctness checks before timing: the
engine's tensors equal the trainer's bytes (SHA-256 over each tensor, on the CPU), the GPU sums
equal the CPU (numpy) ``region_sums``, and one flipped byte in a published bucket is reported
naming the tensor. Appends a table to ``benchmarks/RESULTS.md`` (``--no-append`` to skip).

    python benchmarks/cuda_ipc_sync.py [--engine-gpu 1] [--repeats 10] [--layers 16] [--tune]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import sys
import time
import zlib

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from lora_bucket_export import LAYER, k3_config, layer_slice  # noqa: E402
from results import append, git_commit, today  # noqa: E402

from kimi_core.lora import Adapter  # noqa: E402
from kimi_core.lora.buckets import copy_block_sums, region_sums  # noqa: E402
from kimi_rl_glue.sync.cuda_ipc import _FRAME, CudaIpcAdapterSync  # noqa: E402
from kimi_rl_glue.sync.disk import AdapterSyncError  # noqa: E402


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def set_launch(launch: tuple[int, int, bool]) -> None:
    """Use ``(words per load step, warps, stream hints)`` for ``copy_sum_blocks`` in this process."""
    from kimi_core.kernels import block_sums

    block_sums.CHUNK_WORDS, block_sums.NUM_WARPS, block_sums.STREAM_HINTS = launch


def engine(gpu: int, bucket_bytes: int, conn, launch: tuple[int, int, bool]) -> None:
    """Engine side: receive each announced (manifest, version, checksum, want_digests), answer with timings."""
    torch.cuda.set_device(gpu)
    set_launch(launch)
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


def _host_s(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def repeat_layers(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The layer slice ``n`` times on ``cuda:0`` as layers ``LAYER .. LAYER + n - 1`` (independent copies)."""
    out = {}
    for i in range(n):
        for k, v in tensors.items():
            out[k.replace(f".layers.{LAYER}.", f".layers.{LAYER + i}.")] = v.cuda(0)  # a fresh copy per layer
    return out


def phase_breakdown(nbytes: int = 512 << 20) -> list[str]:
    """Where a checksum's time goes on one GPU (kernel times by CUDA events): the sums kernel alone and
    the fused copy + sums kernel vs a plain copy, at the launch shape in use; across GPUs (2 GPUs)
    torch's peer copy."""
    from kimi_core.lora.block_tables import block_layout

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(buf)
    starts = [0, nbytes // 4, nbytes // 2]
    t = time.perf_counter()
    block_layout(starts, nbytes)
    t_layout = (time.perf_counter() - t) * 1e3
    k_sum = _gpu_ms(lambda: copy_block_sums(buf, None, starts, nbytes))
    k_fused = _gpu_ms(lambda: copy_block_sums(buf, dst, starts, nbytes))
    k_copy = _gpu_ms(lambda: dst.copy_(buf))
    gb = nbytes / 1e9
    out = [f"phase breakdown on {gb:.2f} GB: host layout {t_layout:.2f} ms; sums kernel {k_sum:.3f} ms "
           f"({gb / k_sum * 1e3:.0f} GB/s read); fused copy+sums kernel {k_fused:.3f} ms vs plain copy {k_copy:.3f} ms"]
    if torch.cuda.device_count() > 1:
        far = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        with torch.cuda.device(1):
            p_copy = _gpu_ms(lambda: far.copy_(buf))
        out.append(f"across GPUs on {gb:.2f} GB: torch peer copy cuda:0 -> cuda:1 {p_copy:.3f} ms "
                   f"({gb / p_copy * 1e3:.0f} GB/s, copy engine)")
    return out


def tune_launch(nbytes: int = 512 << 20) -> tuple[tuple[int, int, bool], list[str]]:
    """Sweep ``copy_sum_blocks``' launch shape (words per load step x warps x cache hints) on ``nbytes`` on
    one GPU: copy only, copy + sums, copy + sums + compare, sums only (the fastest shape by the sum of
    the two fused columns wins); with 2 GPUs also time a sums pass on cuda:1 beside a copy-engine transfer
    cuda:0 -> cuda:1 issued as receive issues it. Returns the fastest shape and the tables."""
    from kimi_core.kernels import block_sums
    from kimi_core.lora.block_tables import BLOCK_WORDS, bucket_table

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda:0")
    table, _ = bucket_table((0, nbytes // 4, nbytes // 2), nbytes, torch.device("cuda:0"))
    sums = torch.empty(table.shape[1], dtype=torch.int64, device="cuda:0")
    k_copy = _gpu_ms(lambda: dst.view(torch.uint8).copy_(buf))
    expect = torch.empty_like(sums)
    block_sums.copy_sum_blocks(table, BLOCK_WORDS, src_base=buf.data_ptr(), sums_base=expect.data_ptr())
    flag = torch.zeros((), dtype=torch.int32, device="cuda:0")
    out = [f"launch-shape sweep of copy_sum_blocks on {nbytes / 1e9:.2f} GB (plain torch copy {k_copy:.3f} ms, "
           f"{nbytes / k_copy / 1e6:.0f} GB/s); ms (GB/s):", "",
           "| words per step | warps | stream hints | copy only | copy + sums (trainer) | "
           "copy + sums + compare (engine) | sums only (GB/s read) |", "|---|---|---|---|---|---|---|"]
    best = None
    for chunk, warps, hints in itertools.product((1024, 2048, 4096), (4, 8, 16), (False, True)):
        kw = dict(src_base=buf.data_ptr(), aligned=True, chunk_words=chunk, num_warps=warps, stream_hints=hints)
        run = lambda **more: _gpu_ms(lambda: block_sums.copy_sum_blocks(table, BLOCK_WORDS, **kw, **more), 20)  # noqa: E731
        copy = run(dst_base=dst.data_ptr())
        fused = run(dst_base=dst.data_ptr(), sums_base=sums.data_ptr())
        checked = run(dst_base=dst.data_ptr(), sums_base=sums.data_ptr(), expect_base=expect.data_ptr(), flag=flag)
        only = run(sums_base=sums.data_ptr())
        out.append(f"| {chunk} | {warps} | {hints} | " + " | ".join(
            f"{t:.3f} ({nbytes / t / 1e6:.0f})" for t in (copy, fused, checked, only)) + " |")
        if best is None or fused + checked < best[0]:
            best = (fused + checked, (chunk, warps, hints))
    if int(flag):
        raise SystemExit("tune_launch: the compare flagged identical bytes")
    if torch.cuda.device_count() > 1:
        far = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        other = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:1")
        side, side0 = torch.cuda.Stream(1), torch.cuda.Stream(0)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side0), torch.cuda.stream(side):  # as receive: no default streams
                far.copy_(buf, non_blocking=True)
            copy_block_sums(other, None, [0], nbytes)
            torch.cuda.current_stream().wait_stream(side)

        with torch.cuda.device(1):
            p_copy = _gpu_ms(lambda: far.copy_(buf))
            p_sums = _gpu_ms(lambda: copy_block_sums(other, None, [0], nbytes))
            p_both = _gpu_ms(both)
        out += ["", f"beside a copy-engine transfer cuda:0 -> cuda:1 of {nbytes / 1e9:.2f} GB: copy alone "
                f"{p_copy:.3f} ms, sums pass on cuda:1 alone {p_sums:.3f} ms, both at once {p_both:.3f} ms"]
    return best[1], out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-gpu", type=int, default=1 if torch.cuda.device_count() > 1 else 0)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1,
                    help="copies of the layer slice under distinct layer names (a larger adapter; 0.54 GB each)")
    ap.add_argument("--tune", action="store_true",
                    help="sweep copy_sum_blocks' launch shape first and run the sync with the fastest")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--section-out", default=None, help="also write the section to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    cfg = k3_config()
    E = cfg.n_routed_experts
    bucket = args.bucket_mib << 20
    from kimi_core.kernels import block_sums

    tuned = []
    if args.tune:
        launch, tuned = tune_launch()
        set_launch(launch)
    launch = (block_sums.CHUNK_WORDS, block_sums.NUM_WARPS, block_sums.STREAM_HINTS)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(args.engine_gpu, bucket, child, launch), daemon=True)
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
        runs = {c: [one(adapter, c, experts) for _ in range(args.repeats)] for c in (True, False)}
        (t_on, p_on, r_on), (t_off, _p, _r) = (min(runs[c], key=lambda r: r[0]) for c in (True, False))
        # GPU time of the launches the check changes: the trainer's gather; the engine's one launch when
        # colocated, else its span from the first copy to the last check (sums overlap the copies)
        gpu = {(c, side): min(r[1]["gather_gpu_s"] if side == "trainer" else (r[2]["launch_gpu_s"] or r[2]["copy_gpu_s"])
                              for r in runs[c]) for c in (True, False) for side in ("trainer", "engine")}
        manifest, _ = trainer[True].publish(adapter, version + 1, experts=experts, config=cfg)
        trainer[True].release(version + 1)
        version += 1
        n_body = _FRAME.unpack_from(manifest)[0]
        body, blob = manifest[_FRAME.size:_FRAME.size + n_body], manifest[_FRAME.size + n_body:]
        known = bytes(bytearray(blob))  # the engine's copy of the last checked layout blob
        # per step: the body's CRC-32 on both sides, and the engine comparing the layout blob with its copy
        # (the blob's own CRC is computed once per layout)
        digest = 2 * min(_host_s(lambda: zlib.crc32(body)) for _ in range(5)) + \
            min(_host_s(lambda: blob == known) for _ in range(5))
        # what the check adds: the GPU time of sums + compare on both sides, and the manifest checks
        cost = sum(max(0.0, gpu[True, side] - gpu[False, side]) for side in ("trainer", "engine")) + digest
        nbytes = p_on["bytes"]
        rows.append(dict(layout=layout, experts=n_exp, ep=f"{experts[0]}..{experts[1] - 1}" if experts else "all",
                         gb=nbytes / 1e9, buckets=p_on["buckets"], t_on=t_on, t_off=t_off, gpu=gpu, digest=digest,
                         cost=cost, open=r_on["open_s"]))
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
    hdr = ("| layout | experts | consumer rows | GB | buckets | sync (sums on) | GB/s | sync (sums off) | "
           "wall (on - off) / on | trainer gather GPU on / off | engine GPU on / off | manifest checks | check cost | "
           "check / sync (off) | IPC open (host) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    body = "".join(
        f"| {r['layout']} | {r['experts']} | {r['ep']} | {r['gb']:.3f} | {r['buckets']} | {ms(r['t_on'])} | "
        f"{r['gb'] / r['t_on']:.1f} | {ms(r['t_off'])} | {(r['t_on'] - r['t_off']) / r['t_on'] * 100:.1f}% | "
        f"{ms(r['gpu'][True, 'trainer'])} / {ms(r['gpu'][False, 'trainer'])} | "
        f"{ms(r['gpu'][True, 'engine'])} / {ms(r['gpu'][False, 'engine'])} | {r['digest'] * 1e3:.3f} ms | "
        f"{ms(r['cost'])} | {r['cost'] / r['t_off'] * 100:.2f}% | {ms(r['open'])} |\n" for r in rows)
    where = "another GPU (NVLink)" if args.engine_gpu != 0 else "the same GPU (colocated)"
    section = (f"\n## CUDA-IPC adapter sync, trainer cuda:0 -> engine cuda:{args.engine_gpu} ({where})\n\n"
               f"- date: {today()}\n- machine: {torch.cuda.device_count()}x {gpu}, torch {torch.__version__}\n"
               f"- commit: {git_commit()}\n- command: `python benchmarks/cuda_ipc_sync.py "
               f"{' '.join(sys.argv[1:])}`\n- adapter: rank-32 K3 layer slice (bf16) x {args.layers} layer(s), bucket {args.bucket_mib} MiB, "
               f"best of {args.repeats}\n- check cost = GPU time the sums and compare add (CUDA events, sums on - off, "
               f"trainer gather launch, engine launch (colocated) or receive span (across GPUs), best of {args.repeats} each) + the manifest checks (body CRC-32 on "
               "both sides, the engine comparing the layout blob with the last checked one); wall (on - off) / on is the same difference in wall-clock sync time, where host noise "
               "(IPC opens, allocations) of either run shows\n"
               f"- copy_sum_blocks launch: {launch[0]} words per step, {launch[1]} warps, stream hints {launch[2]}\n\n"
               f"{hdr}{body}\n"
               + "".join(f"- {c}\n" for c in checks) + "".join(f"{t}\n" for t in tuned))
    print(section)
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(section)
    if not args.no_append:
        append(section)


if __name__ == "__main__":
    main()
