"""SGLang serving of a K3-shaped real-width slice through kimi_sglang_plugin: LoRA off and a rank-32 shared-outer
adapter, and the adapter sync rate into the live engine (issue #20 item 4). Needs SGLang 0.5.17 on a GPU
(``shared/gpu/stage_sglang.sh``); nothing here runs on the CPU but ``--print-config``.

What a miles user gets on one GPU: SGLang's offline ``sgl.Engine`` (bf16, triton attention, the Marlin MoE
runner, ``SGLANG_PLUGINS=kimi``) on a checkpoint written once under ``--workdir`` by ``benchmarks/w4_slice.py``:
Kimi K3 widths (hidden 7168, 96 MLA heads and 96 KDA heads of 128, q_lora 1536, kv_lora 512; 896 routed experts
top-16 in MXFP4 at 3584 -> 3072 latent width; 2 shared experts; dense MLP 33792), three layers (a KDA layer with
the dense MLP, a KDA and an MLA layer with MoE), vocab cut to ``--vocab``. Numbers (``serving_bench``): prefill and
decode tok/s with LoRA off (no ``lora_path``, in the LoRA-enabled engine) and with every request on one adapter
(``LoraSpec(rank=32, alpha=64)`` on every linear SGLang gives LoRA, experts shared-outer: the seeds' K3 recipe,
``--experts-shared-outer-loras``), ratio = adapter / off; then the adapter, moved to this process's GPU as a
colocated trainer holds it, synced ``--syncs`` times: ``kimi_sglang_plugin.sync.build_payload`` (flattened bucket,
CUDA-IPC handles) + unload + ``load_lora_adapter_from_tensors``, GB/s = payload bytes / wall of all of it.

    SGLANG_PLUGINS=kimi python benchmarks/sglang_serving.py [--workdir /tmp/kimi_sglang_bench] [--json out.json]
        [--repeats 5] [--syncs 3] [--budget-s 420] [--no-results]
    python benchmarks/sglang_serving.py --print-config        # the slice's config, no engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "kimi_sglang_plugin"))  # the GPU lane's engine flags
import serving_bench  # noqa: E402
from results import append, command, git_commit, today  # noqa: E402
from serving_bench import ServingBench, log  # noqa: E402

serving_bench.TAG = "sglang_serving"
RANK, ALPHA = 32, 64.0
#: decode runs 192 new tokens: without CUDA graphs a step is host-bound (~13 ms at three layers) and 64-token runs of
#: the same config spread 0.73-1.44 s on the H200 (2026-12-03), too much for a LoRA-on / off ratio
SIZES = {"prefill": (8, 1024), "decode": (32, 128, 192)}


def slice_config(vocab: int) -> dict:
    """``make-tiny --model k3``'s config (what the SGLang GPU lane loads: vision stub, token ids, the MXFP4
    ``quantization_config`` with ``targets`` and an ``ignore`` list that leaves every non-expert linear bf16, as
    :mod:`w4_slice` writes them) at the release's K3 widths, three layers (1-based: KDA + dense MLP, KDA + MoE,
    MLA + MoE) and ``vocab``. The release config's own ``quantization_config`` (kimi_arch.md's summary) has no
    ``targets`` (SGLang 0.5.17's compressed-tensors loader iterates them: ``TypeError`` on the H200, 2026-12-02)
    and would quantize the bf16 attention."""
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.release_configs import k3_release_config

    cfg = tiny_config("k3", layers=3)
    rel = k3_release_config()["text_config"]
    t = cfg["text_config"]
    t.update({k: v for k, v in rel.items() if k not in ("num_hidden_layers", "linear_attn_config")})
    t.update(num_hidden_layers=3, vocab_size=vocab)
    t["linear_attn_config"] = {**rel["linear_attn_config"], "kda_layers": [1, 2], "full_attn_layers": [3]}
    return cfg


class SGLangBench(ServingBench):
    def __init__(self, engine, vocab: int, repeats: int, deadline: float):
        super().__init__(vocab, repeats, deadline)
        self.engine = engine

    def run(self, n: int, length: int, new: int, lora) -> tuple[float, int]:
        kw = {"lora_path": [lora] * n} if lora else {}
        ids = self.prompt_ids(n, length)
        t = time.perf_counter()
        outs = self.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new, "temperature": 0.0,
                                                                    "ignore_eos": True}, **kw)
        dt = time.perf_counter() - t
        return dt, sum(int(o["meta_info"]["completion_tokens"]) for o in outs)


def _write_job(out_dir: str, config: dict, queue) -> None:
    """In a spawned process, so this one holds no CUDA memory when the engine starts."""
    from w4_slice import ensure_slice

    queue.put(ensure_slice(out_dir, config, seed=0, device="cuda"))


def write_checkpoint_once(out_dir: str, config: dict) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_write_job, args=(out_dir, config, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"sglang_serving: writing the checkpoint {out_dir} failed (exit {p.exitcode})")
    return q.get(timeout=30)


def _save(res: dict, path: str | None) -> None:
    """The raw numbers to ``path`` (if given), atomically: a run cut short leaves the last complete file."""
    if path:
        from kimi_core.checkpoint.writer import atomic_write_text

        atomic_write_text(path, json.dumps(res, indent=1))


def measure(args) -> dict:
    import sglang as sgl
    import torch

    from kimi_core.config import load_config
    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_sglang_plugin.adapters import prepare_adapter
    from kimi_sglang_plugin.mapping import K3_LORA_LEAVES, lora_target_modules
    from kimi_sglang_plugin.sync import RankLayout, StockSGLangBackend, build_payload
    from sglang_engine_harness import ENGINE_KWARGS, marlin_size_problems, sglang_config_problems

    config = slice_config(args.vocab)
    problems = marlin_size_problems(config["text_config"]) + sglang_config_problems(config["text_config"])
    if problems:
        sys.exit(f"sglang_serving: the slice does not fit SGLang 0.5.17: {problems}")
    res = {"date": today(), "commit": args.commit or git_commit(), "command": command("sglang_serving.py"),
           "gpu": torch.cuda.get_device_name(0), "sglang": sgl.__version__, "configs": [], "syncs": []}
    ckpt_dir = os.path.join(args.workdir, "k3_slice")
    res["checkpoint"] = write_checkpoint_once(ckpt_dir, config)
    log(f"checkpoint {ckpt_dir}: {res['checkpoint']['bytes'] / 2**30:.1f} GiB "
        f"({'written in %.0f s' % res['checkpoint']['seconds'] if res['checkpoint']['written'] else 'reused'})")
    cfg = load_config(ckpt_dir)
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=K3_LORA_LEAVES, expert_layout="shared_outer")
    adapter = prepare_adapter(random_adapter(cfg, spec, seed=1, dtype=torch.bfloat16), cfg)
    kw = {**ENGINE_KWARGS, "context_length": 2048, "max_running_requests": 64, "mem_fraction_static": 0.85,
          "enable_lora": True, "max_lora_rank": RANK, "lora_target_modules": lora_target_modules(K3_LORA_LEAVES),
          "experts_shared_outer_loras": True, "max_loras_per_batch": 2}
    t = time.perf_counter()
    engine = sgl.Engine(model_path=ckpt_dir, **kw)
    res["engine_start_s"] = time.perf_counter() - t
    log(f"engine up in {res['engine_start_s']:.0f} s")
    try:
        backend = StockSGLangBackend(engine=engine)
        name = "kimi-r32"
        payload = build_payload(name, adapter.tensors, adapter.adapter_config, cfg, RankLayout(1, 1, 0),
                                filter_experts=False)
        ans = backend.load(payload, unload_first=False)
        if not getattr(ans, "success", True):
            sys.exit(f"sglang_serving: the adapter was refused: {getattr(ans, 'error_message', ans)}")
        bench = SGLangBench(engine, cfg.vocab_size, args.repeats, serving_bench.T0 + args.budget_s)
        for label, lora in (("off", None), ("one adapter", name)):
            res["configs"].append(bench.config(label, lora, SIZES))
            _save(res, args.json)
        # the timed syncs start where a colocated miles trainer holds its adapter: on the GPU, so SGLang's
        # serializer sends CUDA-IPC handles; each sync is one trainer step's bucketing + serializing + unload + load
        on_gpu = {k: v.to("cuda") for k, v in adapter.tensors.items()}
        for i in range(args.syncs):
            if i and bench.out_of_time():
                break
            torch.cuda.synchronize()
            t = time.perf_counter()
            p = build_payload(name, on_gpu, adapter.adapter_config, cfg, RankLayout(1, 1, 0), filter_experts=False)
            built = time.perf_counter() - t
            ans = backend.load(p, unload_first=True)
            dt = time.perf_counter() - t
            nbytes = sum(b.nbytes for b in p.buckets)
            res["syncs"].append({"bytes": nbytes, "seconds": dt, "build_s": built, "gb_s": nbytes / dt / 1e9,
                                 "transport": "cuda_ipc", "ok": bool(getattr(ans, "success", True))})
            log(f"sync {i}: {nbytes / 2**20:.0f} MiB in {dt:.2f} s (bucketing + serializing {built:.2f} s) = "
                f"{nbytes / dt / 1e9:.2f} GB/s, {'ok' if res['syncs'][-1]['ok'] else 'REFUSED'}")
            _save(res, args.json)
        # the first (CPU) payload once more: its first bytes were received already, fields_for_send serializes again
        ans = backend.load(payload, unload_first=True)
        res["cpu_payload_resent_ok"] = bool(getattr(ans, "success", True))
        log(f"the CPU payload sent a second time: {'accepted' if res['cpu_payload_resent_ok'] else 'REFUSED'}")
        _save(res, args.json)
    finally:
        engine.shutdown()
    return res


def section(res: dict) -> str:
    off = next(r for r in res["configs"] if r["config"] == "off")
    rows = "\n".join(f"| {r['config']} | {r['prefill_tok_s']:.0f} | {r['prefill_tok_s'] / off['prefill_tok_s']:.2f} | "
                     f"{r['decode_tok_s']:.0f} | {r['decode_tok_s'] / off['decode_tok_s']:.2f} | {r['decode_step_ms']:.2f} |"
                     for r in res["configs"])
    sync = (f"{statistics.median(s['gb_s'] for s in res['syncs']):.2f} GB/s (median of {len(res['syncs'])}, "
            f"{res['syncs'][0]['bytes'] / 2**20:.0f} MiB from the trainer process's GPU as CUDA-IPC handles; "
            f"bucketing + serializing {statistics.median(s['build_s'] for s in res['syncs']):.2f} s of it, "
            f"all {'accepted' if all(s['ok'] for s in res['syncs']) else 'NOT all accepted'})") \
        if res["syncs"] else "not measured"
    (P, S), (D, s, T) = SIZES["prefill"], SIZES["decode"]
    return (f"## SGLang serving of a K3 real-width slice through kimi_sglang_plugin ({res['date']}, {res['gpu']})\n\n"
            f"- SGLang {res['sglang']}, commit {res['commit']}; command: `{res['command']}`\n"
            f"- slice: 3 layers (KDA + dense, KDA + MoE, MLA + MoE), 896 MXFP4 experts top-16 at 3584 -> 3072, "
            f"checkpoint {res['checkpoint']['bytes'] / 2**30:.1f} GiB; engine start {res['engine_start_s']:.0f} s\n"
            f"- prefill {P} x {S} tokens; decode batch {D}, prompts of {s}, {T} new tokens; adapter rank {RANK} "
            f"alpha {ALPHA:g} shared-outer on every linear SGLang gives LoRA\n\n"
            "| config | prefill tok/s | vs off | decode tok/s | vs off | decode ms/step |\n|---|---|---|---|---|---|\n"
            f"{rows}\n\nAdapter sync into the live engine (`load_lora_adapter_from_tensors`, flattened bucket): {sync}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/kimi_sglang_bench")
    ap.add_argument("--json", help="write the raw numbers here (after every config)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary of the slice (K3 has 163840)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no repeat or sync starts after this many seconds")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse here)")
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--print-config", action="store_true", help="print the slice's config and exit (no GPU)")
    args = ap.parse_args()
    if args.print_config:
        print(json.dumps(slice_config(args.vocab), indent=1))
        return
    res = measure(args)
    _save(res, args.json)
    text = section(res)
    print(text)
    if not args.no_results:
        append(text)


if __name__ == "__main__":
    main()
