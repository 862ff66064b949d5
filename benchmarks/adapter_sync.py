"""Adapter sync (``kimi_core.sync``, ``kimi_rl_glue.sync``): GB/s and what the one integrity scheme costs.

Every subcommand syncs a rank-32 K3 layer slice (one MLA + latent-MoE decoder layer of the real K3 widths, bf16,
``--experts`` routed experts, per-expert or shared-outer layout), prints a markdown table and writes the numbers
with their date, commit, machine and command as JSON (``--json PATH``). Results: ``docs/performance.md#adapter-sync``.

``buckets`` (CPU): flatten into buckets with and without the checksums (into a persistent staging buffer, and into
a fresh buffer per bucket), the checksums alone, a receiver's verify; a plain copy and SHA-256 beside them.

``disk`` (CPU): the vLLM transport (``DiskAdapterSync``), publish + receive in one process; the checksum's share
is the sender's sums (flatten with minus without) plus the receiver's verify.

``cuda-ipc`` (GPU): the SGLang / miles transport (``CudaIpcAdapterSync``), trainer on cuda:0, engine in a spawned
process on ``--engine-gpu`` (cuda:1 when there are two GPUs, else colocated), shared-outer with all experts and
with one EP=2 rank's experts, and the per-expert layout; sums on against sums off (the same kernels then only
copy). Check cost = the GPU time the sums and compare add (CUDA events: the trainer's gather launch; the engine's
one launch colocated, else its span from the first copy to the last check) + the manifest digests. Before timing:
received bytes equal the sent ones (SHA-256 per tensor), the GPU tensor sums equal the CPU ones, and a byte
flipped after the sums is refused naming its tensor. ``--tune`` first sweeps the block-sum kernel's launch shape
(words per load step x warps x cache hints) and runs with the fastest.

    python benchmarks/adapter_sync.py buckets [--experts 112] [--bucket-mib 256] [--repeats 3] [--json out.json]
    python benchmarks/adapter_sync.py disk [--experts 112] [--bucket-mib 64] [--repeats 3] [--json out.json]
    python benchmarks/adapter_sync.py cuda-ipc [--engine-gpu 1] [--layers 16] [--repeats 10] [--tune] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from provenance import best, markdown_table, stamp, write_json

from kimi_core.config import KimiConfig
from kimi_core.lora import Adapter, LoraSpec
from kimi_core.lora.naming import iter_target_groups
from kimi_core.release_configs import k3_release_config
from kimi_core.sync import iter_buckets
from kimi_core.sync.checksum import copy_block_sums, region_sums

LAYER = 3  # an MLA + MoE layer of K3
PEFT = {"peft_type": "LORA", "r": 32, "lora_alpha": 32, "target_modules": "all-linear"}


# ------------------------------------------------------------------------------------ the adapter
def k3_config() -> KimiConfig:
    """The released K3 config (real widths, 896 routed experts)."""
    return KimiConfig.from_hf(k3_release_config())


def layer_slice(config, layout: str, experts: int, rank: int = 32) -> dict[str, torch.Tensor]:
    """Random bf16 LoRA factors of layer :data:`LAYER` only, ``experts`` routed experts, PEFT names."""
    spec = LoraSpec(rank=rank, expert_layout="shared_outer" if layout == "shared_outer" else "per_expert")
    g, u, d = config.expert_names
    out: dict[str, torch.Tensor] = {}
    for grp in iter_target_groups(config, spec):
        if grp.layer != LAYER:
            continue
        r, fin, fout = grp.rank, grp.in_features, grp.out_features
        if grp.kind != "expert":
            out[f"base_model.model.{grp.module}.lora_A.weight"] = torch.randn(r, fin).bfloat16()
            out[f"base_model.model.{grp.module}.lora_B.weight"] = torch.randn(fout, r).bfloat16()
        elif layout == "per_expert":
            for e in range(experts):
                pre = f"base_model.model.{grp.moe}.experts.{e}.{grp.proj}"
                out[f"{pre}.lora_A.weight"] = torch.randn(r, fin).bfloat16()
                out[f"{pre}.lora_B.weight"] = torch.randn(fout, r).bfloat16()
        else:
            n_a = 1 if grp.proj in (g, u) else experts
            n_b = 1 if grp.proj == d else experts
            pre = f"base_model.model.{grp.moe}.experts.{grp.proj}"
            out[f"{pre}.lora_A.weight"] = torch.randn(n_a, r, fin).bfloat16()
            out[f"{pre}.lora_B.weight"] = torch.randn(n_b, fout, r).bfloat16()
    return out


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sha256_gbs(flat: torch.Tensor) -> float:
    return flat.numel() / best(lambda: hashlib.sha256(flat.numpy()).digest(), 1) / 1e9


# ------------------------------------------------------------------------------------ buckets (CPU)
def run_buckets(args) -> tuple[str, dict]:
    config, bucket_bytes = k3_config(), args.bucket_mib << 20
    rows, raw = [], []

    def export(tensors, checksum, staging=None):
        for _ in iter_buckets(tensors, bucket_bytes, checksum=checksum, staging=staging):
            pass

    def measure(layout: str) -> None:
        tensors = layer_slice(config, layout, args.experts)
        n = nbytes_of(tensors)
        staging = torch.zeros(bucket_bytes, dtype=torch.uint8)  # kept across syncs: its pages are faulted in once
        t_on = best(lambda: export(tensors, True, staging), args.repeats)
        t_off = best(lambda: export(tensors, False, staging), args.repeats)
        t_fresh = best(lambda: export(tensors, True), args.repeats)
        buckets = list(iter_buckets(tensors, bucket_bytes))
        t_sum = best(lambda: [region_sums(b.buffer, b.region_starts()) for b in buckets], args.repeats)
        t_ver = best(lambda: [b.verify() for b in buckets], args.repeats)
        raw.append(
            dict(
                layout=layout,
                tensors=len(tensors),
                bytes=n,
                buckets=len(buckets),
                export_on_s=t_on,
                export_off_s=t_off,
                export_fresh_s=t_fresh,
                sums_s=t_sum,
                verify_s=t_ver,
            )
        )
        rows.append(
            [
                layout,
                len(tensors),
                f"{n / 1e6:.0f}",
                len(buckets),
                f"{n / t_on / 1e9:.2f}",
                f"{n / t_off / 1e9:.2f}",
                f"{n / t_sum / 1e9:.2f}",
                f"{100 * t_sum / t_on:.0f}%",
                f"{n / t_ver / 1e9:.2f}",
                f"{n / t_fresh / 1e9:.2f}",
            ]
        )

    for layout in ("per_expert", "shared_outer"):
        measure(layout)
    flat = torch.randint(0, 255, (raw[0]["bytes"],), dtype=torch.uint8)
    dst = torch.empty_like(flat)
    copy_gbs = flat.numel() / best(lambda: dst.copy_(flat), args.repeats) / 1e9
    sha = sha256_gbs(flat)
    table = markdown_table(
        [
            "layout",
            "tensors",
            "MB",
            "buckets",
            "export GB/s (sums on)",
            "export GB/s (sums off)",
            "sums GB/s",
            "sums share of export",
            "verify GB/s",
            "export GB/s, fresh buffer per bucket",
        ],
        rows,
    )
    table += f"\n\nSame machine: torch uint8 copy {copy_gbs:.2f} GB/s, SHA-256 {sha:.2f} GB/s."
    return table, {"rows": raw, "copy_gb_s": copy_gbs, "sha256_gb_s": sha}


# ------------------------------------------------------------------------------------ disk (CPU)
def run_disk(args) -> tuple[str, dict]:
    from kimi_rl_glue.sync import DiskAdapterSync

    bucket_bytes = args.bucket_mib << 20
    tensors = layer_slice(k3_config(), "per_expert", args.experts)
    adapter = Adapter(tensors, PEFT)
    n = adapter.nbytes
    root = tempfile.mkdtemp(prefix="adapter_sync_disk_", dir=args.workdir)
    try:
        sync = DiskAdapterSync(root, bucket_bytes)
        runs = []
        for version in range(1, args.repeats + 2):  # version 1 warms up
            _, pub = sync.publish(adapter, version)
            t = time.perf_counter()
            got = sync.receive(version)
            runs.append((pub["publish_s"], time.perf_counter() - t, got.extra["sync_timings"]))
            del got
            shutil.rmtree(sync.path(version))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    publish_s, receive_s, rec = min(runs[1:], key=lambda r: r[0] + r[1])
    staging = torch.empty(bucket_bytes, dtype=torch.uint8)

    def flatten(checksum):
        for _ in iter_buckets(tensors, bucket_bytes, checksum=checksum, staging=staging):
            pass

    send_sums = max(0.0, best(lambda: flatten(True), args.repeats) - best(lambda: flatten(False), args.repeats))
    total, check = publish_s + receive_s, send_sums + rec["verify_s"]
    sha = sha256_gbs(next(iter_buckets(tensors, bucket_bytes)).buffer)
    gb = n / 1e9
    table = markdown_table(
        [
            "tensors",
            "MB",
            "sync GB/s (publish + receive)",
            "publish GB/s",
            "receive GB/s",
            "sender sums s",
            "receiver verify s",
            "checksum share of sync",
        ],
        [
            [
                len(tensors),
                f"{n / 1e6:.0f}",
                f"{gb / total:.2f}",
                f"{gb / publish_s:.2f}",
                f"{gb / receive_s:.2f}",
                f"{send_sums:.3f}",
                f"{rec['verify_s']:.3f}",
                f"{100 * check / total:.0f}%",
            ]
        ],
    )
    table += f"\n\nBest of {args.repeats} versions after one warm-up; SHA-256 on this machine {sha:.2f} GB/s."
    return table, {
        "tensors": len(tensors),
        "bytes": n,
        "publish_s": publish_s,
        "receive_s": receive_s,
        "read_s": rec["read_s"],
        "verify_s": rec["verify_s"],
        "sender_sums_s": send_sums,
        "sha256_gb_s": sha,
    }


# ------------------------------------------------------------------------------------ cuda-ipc (GPU)
def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in tensors.items()
    }


def set_launch(launch: tuple[int, int, bool]) -> None:
    """Use ``(words per load step, warps, stream hints)`` for the block-sum kernel in this process."""
    from kimi_core.kernels import block_sums

    block_sums.CHUNK_WORDS, block_sums.NUM_WARPS, block_sums.STREAM_HINTS = launch


def engine(gpu: int, bucket_bytes: int, conn, launch: tuple[int, int, bool]) -> None:
    """Engine process: receive each announced (manifest, version, checksum, want digests), answer with timings."""
    from kimi_core.sync import AdapterSyncError
    from kimi_rl_glue.sync.cuda_ipc import CudaIpcAdapterSync

    torch.cuda.set_device(gpu)
    set_launch(launch)
    syncs = {c: CudaIpcAdapterSync(gpu, bucket_bytes, checksum=c) for c in (True, False)}
    while (msg := conn.recv()) is not None:
        manifest, version, checksum, want = msg
        t = time.perf_counter()
        try:
            ad = syncs[checksum].receive(version, manifest)
        except AdapterSyncError as e:
            conn.send({"error": str(e)})
            continue
        dt = time.perf_counter() - t
        conn.send({"receive_s": dt, **ad.extra["sync_timings"], "digests": _digests(ad.tensors) if want else None})
        del ad


def _gpu_ms(fn, repeats: int = 5) -> float:
    """Best GPU time of ``fn`` (CUDA events) after one warm-up, ms."""
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


def _manifest_check_s(body: bytes, blob: bytes, known: bytes) -> float:
    """What a step's manifest check costs: the body's digest on both sides, and the engine comparing the layout
    blob with its copy of the last checked one (the blob's own digest is computed once per layout)."""
    from kimi_core.sync.checksum import digest

    return 2 * min(_host_s(lambda: digest(body)) for _ in range(5)) + min(
        _host_s(lambda: blob == known) for _ in range(5)
    )


def repeat_layers(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The layer slice ``n`` times on cuda:0 as layers ``LAYER .. LAYER + n - 1`` (independent copies)."""
    return {
        k.replace(f".layers.{LAYER}.", f".layers.{LAYER + i}."): v.cuda(0) for i in range(n) for k, v in tensors.items()
    }


def tune_launch(nbytes: int = 512 << 20) -> tuple[tuple[int, int, bool], list[dict]]:
    """Sweep the block-sum kernel's launch shape on ``nbytes`` on cuda:0: copy only, copy + sums (trainer),
    copy + sums + compare (engine), sums only; the fastest by the two fused columns wins."""
    from kimi_core.kernels import block_sums
    from kimi_core.sync.block_tables import bucket_table
    from kimi_core.sync.checksum import BLOCK_WORDS

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda:0")
    table, _ = bucket_table((0, nbytes // 4, nbytes // 2), nbytes, torch.device("cuda:0"))
    sums = torch.empty(table.shape[1], dtype=torch.int64, device="cuda:0")
    expect = torch.empty_like(sums)
    block_sums.copy_sum_blocks(table, BLOCK_WORDS, src_base=buf.data_ptr(), sums_base=expect.data_ptr())
    flag = torch.zeros((), dtype=torch.int32, device="cuda:0")
    sweep, best_shape = [], None
    for chunk, warps, hints in itertools.product((1024, 2048, 4096), (4, 8, 16), (False, True)):
        kw = dict(src_base=buf.data_ptr(), aligned=True, chunk_words=chunk, num_warps=warps, stream_hints=hints)

        def run(kw=kw, **more):
            return _gpu_ms(lambda: block_sums.copy_sum_blocks(table, BLOCK_WORDS, **kw, **more), 20)

        rec = dict(
            chunk_words=chunk,
            num_warps=warps,
            stream_hints=hints,
            copy_ms=run(dst_base=dst.data_ptr()),
            copy_sums_ms=run(dst_base=dst.data_ptr(), sums_base=sums.data_ptr()),
            copy_sums_compare_ms=run(
                dst_base=dst.data_ptr(), sums_base=sums.data_ptr(), expect_base=expect.data_ptr(), flag=flag
            ),
            sums_ms=run(sums_base=sums.data_ptr()),
        )
        sweep.append(rec)
        score = rec["copy_sums_ms"] + rec["copy_sums_compare_ms"]
        if best_shape is None or score < best_shape[0]:
            best_shape = (score, (chunk, warps, hints))
    if int(flag):
        raise SystemExit("tune: the compare flagged identical bytes")
    return best_shape[1], sweep


def run_cuda_ipc(args) -> tuple[str, dict]:
    import torch.multiprocessing as mp

    from kimi_core.kernels import block_sums
    from kimi_core.sync import AdapterSyncError, filter_experts
    from kimi_rl_glue.sync.cuda_ipc import FRAME, CudaIpcAdapterSync

    if not torch.cuda.is_available():
        raise SystemExit("cuda-ipc: needs a CUDA device")
    engine_gpu = args.engine_gpu if args.engine_gpu is not None else (1 if torch.cuda.device_count() > 1 else 0)
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    cfg = k3_config()
    n_exp_all = cfg.n_routed_experts
    bucket = args.bucket_mib << 20
    sweep = []
    if args.tune:
        launch, sweep = tune_launch()
        set_launch(launch)
    launch = (block_sums.CHUNK_WORDS, block_sums.NUM_WARPS, block_sums.STREAM_HINTS)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(engine_gpu, bucket, child, launch), daemon=True)
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

    raw, checks = [], []
    try:
        for layout, n_exp, experts in [
            ("shared_outer", n_exp_all, None),
            ("shared_outer", n_exp_all, (0, n_exp_all // 2)),
            ("per_expert", 112, None),
        ]:
            tensors = repeat_layers(layer_slice(cfg, layout, n_exp), args.layers)
            adapter = Adapter(tensors, PEFT, source="bench")
            _, _, rt = one(adapter, True, experts, want=True)
            sent = filter_experts(tensors, cfg, *experts) if experts else tensors
            if rt["digests"] != _digests(sent):
                raise SystemExit(f"{layout} experts={experts}: the received adapter differs from the sent one")
            checks.append(f"{layout} E={n_exp} experts={experts}: received bytes == sent (SHA-256 per tensor)")
            for _ in range(2):  # warm-up both paths
                one(adapter, True, experts)
                one(adapter, False, experts)
            runs = {c: [one(adapter, c, experts) for _ in range(args.repeats)] for c in (True, False)}
            (t_on, p_on, r_on), (t_off, _, _) = (min(runs[c], key=lambda r: r[0]) for c in (True, False))

            def gpu_s(c, side, runs=runs):
                return min(
                    r[1]["gather_gpu_s"] if side == "trainer" else (r[2]["launch_gpu_s"] or r[2]["copy_gpu_s"])
                    for r in runs[c]
                )

            version += 1
            manifest, _ = trainer[True].publish(adapter, version, experts=experts, config=cfg)
            trainer[True].release(version)
            n_body = FRAME.unpack_from(manifest)[0]
            body, blob = manifest[FRAME.size : FRAME.size + n_body], manifest[FRAME.size + n_body :]
            known = bytes(bytearray(blob))  # the engine's copy of the last checked layout blob
            manifest_s = _manifest_check_s(body, blob, known)
            cost = sum(max(0.0, gpu_s(True, side) - gpu_s(False, side)) for side in ("trainer", "engine")) + manifest_s
            raw.append(
                dict(
                    layout=layout,
                    experts=n_exp,
                    consumer=f"{experts[0]}..{experts[1] - 1}" if experts else "all",
                    bytes=p_on["bytes"],
                    buckets=p_on["buckets"],
                    sync_on_s=t_on,
                    sync_off_s=t_off,
                    trainer_gpu_on_s=gpu_s(True, "trainer"),
                    trainer_gpu_off_s=gpu_s(False, "trainer"),
                    engine_gpu_on_s=gpu_s(True, "engine"),
                    engine_gpu_off_s=gpu_s(False, "engine"),
                    manifest_s=manifest_s,
                    check_cost_s=cost,
                    open_s=r_on["open_s"],
                )
            )
            del tensors, adapter
            torch.cuda.empty_cache()

        small = {k: v.cuda(0) for k, v in layer_slice(cfg, "shared_outer", 8).items()}
        b = next(iter_buckets(small, 64 << 20, device="cuda:0"))
        same = [m.sum for m in b.metas] == region_sums(b.buffer.cpu(), b.region_starts(), b.nbytes)
        checks.append(f"GPU tensor sums == CPU tensor sums on a {b.nbytes / 1e6:.1f} MB bucket: {same}")
        version += 1
        manifest, _ = trainer[True].publish(Adapter(small, PEFT, source="bench"), version)
        live = trainer[True]._live[version][0]
        victim = live.metas[len(live.metas) // 2]
        live.buffer[victim.offset + 3] ^= 0x10  # after the sums: a byte flipped in flight
        torch.cuda.synchronize()
        parent.send((manifest, version, True, False))
        rt = parent.recv()
        checks.append(
            f"flipped byte in {victim.name}: refused naming it: {'error' in rt and victim.name in rt['error']}"
        )
        probe = torch.randint(0, 256, (512 << 20,), dtype=torch.uint8, device="cuda:0")
        probe_dst = torch.empty_like(probe)
        kernel = dict(
            sums_ms=_gpu_ms(lambda: copy_block_sums(probe, None, [0], probe.numel())),
            copy_sums_ms=_gpu_ms(lambda: copy_block_sums(probe, probe_dst, [0], probe.numel())),
            copy_ms=_gpu_ms(lambda: probe_dst.copy_(probe)),
            bytes=probe.numel(),
        )
    finally:
        parent.send(None)
        proc.join(timeout=60)

    def ms(x):
        return f"{x * 1e3:.2f}"

    rows = [
        [
            r["layout"],
            r["experts"],
            r["consumer"],
            f"{r['bytes'] / 1e9:.3f}",
            r["buckets"],
            ms(r["sync_on_s"]),
            f"{r['bytes'] / 1e9 / r['sync_on_s']:.1f}",
            ms(r["sync_off_s"]),
            f"{ms(r['trainer_gpu_on_s'])} / {ms(r['trainer_gpu_off_s'])}",
            f"{ms(r['engine_gpu_on_s'])} / {ms(r['engine_gpu_off_s'])}",
            f"{r['manifest_s'] * 1e3:.3f}",
            ms(r["check_cost_s"]),
            f"{100 * r['check_cost_s'] / r['sync_off_s']:.2f}%",
            ms(r["open_s"]),
        ]
        for r in raw
    ]
    table = markdown_table(
        [
            "layout",
            "experts",
            "consumer rows",
            "GB",
            "buckets",
            "sync ms (sums on)",
            "GB/s",
            "sync ms (sums off)",
            "trainer gather GPU ms on / off",
            "engine GPU ms on / off",
            "manifest digests ms",
            "check cost ms",
            "check / sync (off)",
            "IPC open ms",
        ],
        rows,
    )
    where = "another GPU" if engine_gpu != 0 else "the same GPU (colocated)"
    table += (
        f"\n\nTrainer cuda:0 -> engine cuda:{engine_gpu} ({where}); {args.layers} layer slice(s), "
        f"{args.bucket_mib} MiB buckets, best of {args.repeats}; block-sum launch {launch[0]} words per step, "
        f"{launch[1]} warps, stream hints {launch[2]}.\n"
        + "".join(f"\n- {c}" for c in checks)
        + f"\n- one {kernel['bytes'] / 1e9:.2f} GB buffer: sums {kernel['sums_ms']:.3f} ms, copy + sums "
        f"{kernel['copy_sums_ms']:.3f} ms, torch copy {kernel['copy_ms']:.3f} ms"
    )
    return table, {
        "engine_gpu": engine_gpu,
        "launch": launch,
        "rows": raw,
        "checks": checks,
        "kernel": kernel,
        "tune": sweep,
    }


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name, bucket_mib, repeats in (("buckets", 256, 3), ("disk", 64, 3), ("cuda-ipc", 256, 10)):
        p = sub.add_parser(name)
        p.add_argument("--bucket-mib", type=int, default=bucket_mib)
        p.add_argument("--repeats", type=int, default=repeats)
        p.add_argument("--json", default=None, help="write the numbers here")
        if name != "cuda-ipc":
            p.add_argument("--experts", type=int, default=112, help="routed experts of the slice (112: one EP=8 rank)")
    sub.choices["disk"].add_argument("--workdir", default=None, help="where the versions are written (a temp dir)")
    ipc = sub.choices["cuda-ipc"]
    ipc.add_argument("--engine-gpu", type=int, default=None, help="the engine's GPU (default: 1 if there are two)")
    ipc.add_argument("--layers", type=int, default=1, help="copies of the layer slice (a larger adapter)")
    ipc.add_argument("--tune", action="store_true", help="sweep the block-sum kernel's launch shape first")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    run = {"buckets": run_buckets, "disk": run_disk, "cuda-ipc": run_cuda_ipc}[args.what]
    table, numbers = run(args)
    print(table)
    write_json(args.json, {**stamp("adapter_sync.py"), "subcommand": args.what, **numbers})


if __name__ == "__main__":
    main()
