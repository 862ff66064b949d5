"""Serving throughput through the Kimi engine plugins on real-width slices: LoRA off against LoRA on, and the cost
of putting a new adapter version into the live engine. Prints a table and writes the raw numbers as JSON
(``--json``, rewritten after every phase, so a run cut short still leaves what it measured).

``vllm``: a K2-shaped slice through ``kimi_vllm_plugin`` (vLLM's offline ``LLM``, ``VLLM_PLUGINS=kimi``): Kimi K2
widths (hidden 7168, 64 MLA heads, q_lora 1536, kv_lora 512; 384 routed experts top-8 at 7168 -> 2048 in INT4
``pack-quantized``, group 32, Kimi QAT scales; 1 shared expert; dense MLP 18432), ``--layers`` layers (default 2:
one dense, one MoE), vocab cut to ``--vocab``. Configs: ``off`` (no ``lora_request``, in the same LoRA-enabled
engine), ``one`` (every request on one rank-32 adapter, experts at rank 32 / top-k through ``rank_pattern``),
``two`` (half the batch on each of two adapters); ``hotload``: ``KimiLoraClient.load`` of version n+1 while n is
loaded, split into the client's validation and staging, vLLM's ``add_lora`` and ``remove_lora``, then the first
request on the new version. vLLM's log lines naming the MoE method, Marlin, the LoRA path and the attention
backend are kept. ``--tiny`` runs the same flow at ``make-tiny`` sizes on the CPU engine (checks the script).

``sglang``: a K3-shaped slice through ``kimi_sglang_plugin`` (SGLang's offline ``sgl.Engine``, triton attention,
the Marlin MoE runner, ``SGLANG_PLUGINS=kimi``): Kimi K3 widths (hidden 7168, 96 MLA and KDA heads of 128; 896
routed experts top-16 in MXFP4 at 3584 -> 3072; 2 shared experts; dense MLP 33792), three layers (KDA + dense MLP,
KDA + MoE, MLA + MoE). Configs ``off`` and ``one adapter`` (rank 32, alpha 64, shared-outer experts, every linear
SGLang gives LoRA: the miles K3 recipe); then ``--syncs`` adapter syncs from this process's GPU as a colocated
trainer holds it (``build_payload``'s flattened bucket as CUDA-IPC handles + unload + load), GB/s = payload bytes
over the wall of all of it. Needs SGLang 0.5.17 on a GPU; ``--print-config`` prints the slice's config on any host.

Both: prefill tok/s = ``P * S / wall`` for ``P`` prompts of ``S`` tokens and one new token; decode tok/s =
``D * (T - 1) / (wall(T) - wall(1))`` for ``D`` prompts generating ``T`` tokens (EOS ignored), i.e. the tokens
after the first over the time beyond prefill; the median of ``--repeats`` after an untimed warm-up of each batch
shape; fresh random prompt ids every run (no prefix cache hit); no repeat or phase starts after ``--budget-s``.
Checkpoints are written once under ``--workdir`` (``benchmarks/w4_slice.py``) and reused while unchanged.

    VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/serving.py vllm [--json out.json] [--phases off,one,two,hotload]
    .venv/bin/python benchmarks/serving.py vllm --tiny --workdir /tmp/vbench_tiny     # CPU engine, tiny sizes
    python benchmarks/serving.py sglang [--json out.json] [--repeats 5] [--syncs 3]
    python benchmarks/serving.py sglang --print-config

Results: ``docs/performance.md#vllm-serving`` and ``#sglang-serving``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: worker_probe.model_info runs in vLLM's worker (LLM.apply_model), which imports it by name from here
VLLM_PROBE_DIR = os.path.join(ROOT, "tests", "kimi_vllm_plugin")
#: the SGLang GPU lane's engine flags and size checks (sglang_engine_harness)
SGLANG_HARNESS_DIR = os.path.join(ROOT, "tests", "kimi_sglang_plugin")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from provenance import cpu_name, markdown_table, stamp, write_json

# ------------------------------------------------------------------------------------ both engines
#: the log prefix (the subcommand) and the clock its elapsed seconds count from
TAG = "serving"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{TAG} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class ServingBench:
    """One engine's timed calls (prefill and decode tok/s of a config); subclasses implement :meth:`run`."""

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
        row = {
            "config": name,
            "prefill_tok_s": P * S / p,
            "decode_tok_s": D * (T - 1) / max(dT - d1, 1e-9),
            "prefill_s": pre,
            "decode_prefill_only_s": dec1,
            "decode_s": decT,
            "generated_tokens": gen,
            "expected_tokens": D * T,
            "decode_step_ms": (dT - d1) / (T - 1) * 1e3,
        }
        if any(g != D * T for g in gen):
            log(f"WARNING {name}: generated {gen} tokens, expected {D * T} per run (EOS ignored)")
        log(
            f"{name}: prefill {row['prefill_tok_s']:.0f} tok/s, decode {row['decode_tok_s']:.0f} tok/s "
            f"({row['decode_step_ms']:.2f} ms/step at batch {D})"
        )
        return row


def _write_job(out_dir: str, config: dict, device: str, queue) -> None:
    """Runs in a spawned process, so this one never holds CUDA memory when the engine starts."""
    from w4_slice import ensure_slice

    info = ensure_slice(out_dir, config, seed=0, device=device)
    if device == "cuda":
        import torch

        info["device_name"] = torch.cuda.get_device_name(0)
    else:
        info["device_name"] = cpu_name()
    queue.put(info)


def write_checkpoint_once(out_dir: str, config: dict, device: str) -> dict:
    """Write the slice under ``out_dir`` unless it is there with this config; returns ``ensure_slice``'s info."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_write_job, args=(out_dir, config, device, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"serving: writing the checkpoint {out_dir} failed (exit {p.exitcode})")
    return q.get(timeout=30)


def ratio_table(res: dict, labels: dict[str, str]) -> str:
    """Prefill / decode tok/s of each config and its ratio to ``off``."""
    off = next((r for r in res["configs"] if r["config"] == "off"), None)
    rows = []
    for r in res["configs"]:

        def vs(k: str, r: dict = r) -> str:
            return f"{r[k] / off[k]:.3f}x" if off else "n/a"

        rows.append(
            [
                labels.get(r["config"], r["config"]),
                f"{r['prefill_tok_s']:.0f}",
                vs("prefill_tok_s"),
                f"{r['decode_tok_s']:.0f}",
                vs("decode_tok_s"),
                f"{r['decode_step_ms']:.2f}",
            ]
        )
    return markdown_table(["config", "prefill tok/s", "vs off", "decode tok/s", "vs off", "decode ms/step"], rows)


# ------------------------------------------------------------------------------------------- vLLM
VLLM_PHASES = ("off", "one", "two", "hotload")
LORA_RANK, LORA_ALPHA = 32, 64.0  # the adapters of both engines
#: sizes per mode; everything else (engine flags aside) is shared
VLLM_SIZES = {
    "gpu": dict(
        prefill=(64, 1024), decode=(64, 128, 256), max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85
    ),
    # CPU: the KV cache is sized in bytes from these lengths (kimi_vllm_plugin.cpu_engine), not a fraction
    "tiny": dict(prefill=(4, 64), decode=(4, 16, 8), max_model_len=256, max_num_seqs=8, gpu_memory_utilization=None),
}
#: real K2 widths put on the make-tiny K2 config (kimi_core.release_configs.k2_release_config)
K2_WIDTH_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "intermediate_size",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
)
#: vLLM log lines worth keeping: which MoE method / kernels / LoRA path / attention backend ran
LOG_PATTERNS = re.compile(
    r"MoEMethod|Marlin|MARLIN|Punica|LoRA|lora|[Bb]ackend|kimi|CUDA graph|cudagraph|"
    r"[Cc]ompil|Model loading took|KV cache|init engine",
    re.I,
)


def vllm_slice_config(tiny: bool, layers: int, vocab: int) -> dict:
    """HF config of the served checkpoint: ``make-tiny`` K2 (INT4 experts) with K2 widths unless ``tiny``."""
    from kimi_core.checkpoint.tiny import tiny_config
    from kimi_core.release_configs import k2_release_config

    cfg = tiny_config("k2", layers=layers)
    if not tiny:
        rel = k2_release_config()
        cfg.update({k: rel[k] for k in K2_WIDTH_KEYS}, vocab_size=vocab)
    return cfg


def write_adapters(config, root: str, seeds: dict[str, int]) -> dict[str, str]:
    """``{tag: dir}`` of random rank-32 adapters (capacity-normalised expert rank), one seed each, bf16."""
    import torch

    from kimi_core.lora import LoraSpec, random_adapter

    spec = LoraSpec(
        rank=LORA_RANK,
        alpha=LORA_ALPHA,
        target_modules="all-linear",
        exclude_modules=("kv_b_proj",),
        expert_layout="per_expert",
        normalize_moe_lora=True,
    )
    return {
        tag: random_adapter(config, spec, seed=s, dtype=torch.bfloat16, b_std=0.3).save(os.path.join(root, tag))
        for tag, s in seeds.items()
    }


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
                if ln.startswith(f"[{TAG} "):
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
    return {
        "moe_method": first(r"\w+MoEMethod\w*", lines) or first(r"\w+", moe),
        "marlin": first(r"[^.]*Marlin[^.]*|[^.]*MARLIN[^.]*", lines),
        "punica": first(r"Punica\w+", lines) or first(r"\w+", punica),
        "moe_lora": first(r"[^.]*(FusedMoE\w*LoRA|MoE\w* LoRA|fused_moe_lora)[^.]*", lines)
        or first(r"\w*(MoE|Expert)\w*LoRA\w*", lora),
        "attention": first(r"Using \w+ (attention )?backend[^.]*|\w+_MLA\w*", lines),
        "modules": sorted(set(lora + moe)),
    }


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


class VLLMBench(ServingBench):
    """One vLLM engine: :class:`ServingBench` plus the hot-load timing."""

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
            rows.append(
                {
                    "name": req.lora_name,
                    "total_s": total,
                    "add_lora_s": add,
                    "remove_lora_s": rm,
                    "prepare_s": total - add - rm,
                    "first_request_s": first,
                    "second_request_s": again,
                }
            )
            log(
                f"hot-load {req.lora_name}: {total:.3f} s (prepare {total - add - rm:.3f}, add_lora {add:.3f}, "
                f"remove_lora {rm:.3f}); first request {first * 1e3:.1f} ms, again {again * 1e3:.1f} ms"
            )
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "name"}
        return {"loads": rows, "median": med}


VLLM_LABELS = {
    "off": "LoRA off (no lora_request)",
    "one": "1 adapter, rank 32 (experts 32/top-k)",
    "two": "2 adapters, half the batch each",
}


def vllm_table(res: dict) -> str:
    """The configs' tok/s and ratios to ``off``, then the hot-load's median split."""
    L = [ratio_table(res, VLLM_LABELS)]
    hl = res.get("hotload")
    if hl:
        m = hl["median"]
        L += [
            "",
            f"Hot-load of a new adapter version from disk (`KimiLoraClient.load` while the previous version "
            f"is loaded; median of {len(hl['loads'])}; adapter {res['adapter_mb']:.0f} MB bf16):",
            "",
            "| total | client validation + staging | vLLM add_lora | vLLM remove_lora (old version) | "
            "first request on the new version | same request again |",
            "|---|---|---|---|---|---|",
            f"| {m['total_s']:.3f} s | {m['prepare_s']:.3f} s | {m['add_lora_s']:.3f} s | "
            f"{m['remove_lora_s']:.3f} s | {m['first_request_s'] * 1e3:.1f} ms | "
            f"{m['second_request_s'] * 1e3:.1f} ms |",
        ]
    return "\n".join(L)


def measure_vllm(args, phases: list[str]) -> dict:
    """Write the checkpoint and adapters (once), start the engine, run ``phases``; returns the raw numbers
    (also written to ``--json`` after every phase)."""
    mode = "tiny" if args.tiny else "gpu"
    sizes = VLLM_SIZES[mode]
    eager = args.eager or args.tiny
    config = vllm_slice_config(args.tiny, args.layers, args.vocab)
    ckpt = os.path.join(args.workdir, f"k2_{mode}_L{args.layers}_v{config['vocab_size']}")
    log(f"checkpoint {ckpt}: writing unless present")
    info = write_checkpoint_once(ckpt, config, "cpu" if args.tiny else "cuda")
    how = f"written in {info['seconds']:.1f} s" if info["written"] else "reused"
    log(f"checkpoint {how}: {info['bytes'] / 1e9:.2f} GB")

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
    # worker imports worker_probe from VLLM_PROBE_DIR
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (VLLM_PROBE_DIR, os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, VLLM_PROBE_DIR)
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
    from kimi_vllm_plugin.cpu_engine import cpu_kv_cache_kwargs

    # CPU: explicit bytes; GPU: the fraction of the device
    mem = cpu_kv_cache_kwargs(ckpt, sizes["max_model_len"], sizes["max_num_seqs"]) or {
        "gpu_memory_utilization": sizes["gpu_memory_utilization"]
    }
    llm = LLM(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=sizes["max_model_len"],
        max_num_seqs=sizes["max_num_seqs"],
        enforce_eager=eager,
        seed=0,
        **lora,
        **mem,
    )
    start_s = time.perf_counter() - t
    log(f"engine started in {start_s:.1f} s")
    res = {
        **stamp("serving.py"),
        "kv_cache": mem,
        "tiny": args.tiny,
        "eager": eager,
        "sizes": sizes,
        "repeats": args.repeats,
        "engine_start_s": start_s,
        "checkpoint": info,
        "device_name": info["device_name"],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "adapter_mb": adapter_mb,
        "configs": [],
        "phases": phases,
        "model": (
            f"K2 {'make-tiny' if args.tiny else 'real-width'} slice, {config['num_hidden_layers']} layers "
            f"({config['first_k_dense_replace']} dense), hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']} MLA heads, {config['n_routed_experts']} INT4 experts top-"
            f"{config['num_experts_per_tok']} ({config['hidden_size']} -> {config['moe_intermediate_size']}), "
            f"vocab {config['vocab_size']} (cut), {info['bytes'] / 1e9:.1f} GB on disk"
        ),
    }
    try:
        res["max_num_batched_tokens"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    except AttributeError:
        pass
    try:
        res["model_info"] = llm.apply_model(model_info)[0]
    except Exception as e:
        res["model_info"] = {"error": f"{type(e).__name__}: {e}"}
    log(f"served classes: { {k: v for k, v in res['model_info'].items() if k != 'tower_params'} }")

    bench = VLLMBench(llm, config["vocab_size"], args.repeats, T0 + args.budget_s)
    clients = {}
    for tag, first_id in (("A", 1), ("B", 1001)):
        c = KimiLoraClient.offline(
            llm,
            ckpt,
            max_lora_rank=LORA_RANK,
            stage_dir=os.path.join(args.workdir, "stage"),
            base_name=f"policy{tag}",
            first_int_id=first_id,
        )
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
        write_json(args.json, res)

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
    res["total_s"] = time.perf_counter() - T0
    dump()
    tee.restore()
    return res


# ------------------------------------------------------------------------------------------- SGLang
#: decode runs 192 new tokens: without CUDA graphs a step is host-bound at three layers and shorter runs of the same
#: config spread too much for a LoRA-on / off ratio (docs/performance.md#sglang-serving)
SGLANG_SIZES = {"prefill": (8, 1024), "decode": (32, 128, 192)}


def sglang_slice_config(vocab: int) -> dict:
    """``make-tiny --model k3``'s config (what the SGLang GPU lane loads: vision stub, token ids, the MXFP4
    ``quantization_config`` with ``targets`` and an ``ignore`` list that leaves every non-expert linear bf16, as
    :mod:`w4_slice` writes them) at the release's K3 widths, three layers (1-based: KDA + dense MLP, KDA + MoE,
    MLA + MoE) and ``vocab``. The release config's own ``quantization_config`` has no ``targets`` (SGLang 0.5.17's
    compressed-tensors loader iterates them and raises ``TypeError``) and would quantize the bf16 attention."""
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
        outs = self.engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}, **kw
        )
        dt = time.perf_counter() - t
        return dt, sum(int(o["meta_info"]["completion_tokens"]) for o in outs)


def measure_sglang(args) -> dict:
    """Write the slice (once), start the engine with LoRA on, time ``off`` and one adapter, then the syncs."""
    import sglang as sgl
    import torch

    from kimi_core.config import load_config
    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_sglang_plugin.adapters import prepare_adapter
    from kimi_sglang_plugin.mapping import K3_LORA_LEAVES, lora_target_modules
    from kimi_sglang_plugin.sync import RankLayout, StockSGLangBackend, build_payload

    sys.path.insert(0, SGLANG_HARNESS_DIR)
    from sglang_engine_harness import ENGINE_KWARGS, marlin_size_problems, sglang_config_problems

    config = sglang_slice_config(args.vocab)
    problems = marlin_size_problems(config["text_config"]) + sglang_config_problems(config["text_config"])
    if problems:
        sys.exit(f"serving sglang: the slice does not fit SGLang 0.5.17: {problems}")
    res = {
        **stamp("serving.py"),
        "gpu": torch.cuda.get_device_name(0),
        "sglang": sgl.__version__,
        "configs": [],
        "syncs": [],
    }
    ckpt_dir = os.path.join(args.workdir, "k3_slice")
    res["checkpoint"] = write_checkpoint_once(ckpt_dir, config, "cuda")
    ck = res["checkpoint"]
    how = f"written in {ck['seconds']:.0f} s" if ck["written"] else "reused"
    log(f"checkpoint {ckpt_dir}: {ck['bytes'] / 2**30:.1f} GiB ({how})")
    cfg = load_config(ckpt_dir)
    spec = LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=K3_LORA_LEAVES, expert_layout="shared_outer")
    adapter = prepare_adapter(random_adapter(cfg, spec, seed=1, dtype=torch.bfloat16), cfg)
    kw = {
        **ENGINE_KWARGS,
        "context_length": 2048,
        "max_running_requests": 64,
        "mem_fraction_static": 0.85,
        "enable_lora": True,
        "max_lora_rank": LORA_RANK,
        "lora_target_modules": lora_target_modules(K3_LORA_LEAVES),
        "experts_shared_outer_loras": True,
        "max_loras_per_batch": 2,
    }
    t = time.perf_counter()
    engine = sgl.Engine(model_path=ckpt_dir, **kw)
    res["engine_start_s"] = time.perf_counter() - t
    log(f"engine up in {res['engine_start_s']:.0f} s")
    try:
        backend = StockSGLangBackend(engine=engine)
        name = "kimi-r32"
        payload = build_payload(
            name, adapter.tensors, adapter.adapter_config, cfg, RankLayout(1, 1, 0), filter_experts=False
        )
        ans = backend.load(payload, unload_first=False)
        if not getattr(ans, "success", True):
            sys.exit(f"serving sglang: the adapter was refused: {getattr(ans, 'error_message', ans)}")
        bench = SGLangBench(engine, cfg.vocab_size, args.repeats, T0 + args.budget_s)
        for label, lora in (("off", None), ("one adapter", name)):
            res["configs"].append(bench.config(label, lora, SGLANG_SIZES))
            write_json(args.json, res)
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
            res["syncs"].append(
                {
                    "bytes": nbytes,
                    "seconds": dt,
                    "build_s": built,
                    "gb_s": nbytes / dt / 1e9,
                    "transport": "cuda_ipc",
                    "ok": bool(getattr(ans, "success", True)),
                }
            )
            log(
                f"sync {i}: {nbytes / 2**20:.0f} MiB in {dt:.2f} s (bucketing + serializing {built:.2f} s) = "
                f"{nbytes / dt / 1e9:.2f} GB/s, {'ok' if res['syncs'][-1]['ok'] else 'REFUSED'}"
            )
            write_json(args.json, res)
        # the first (CPU) payload once more: its first bytes were received already, fields_for_send serializes again
        ans = backend.load(payload, unload_first=True)
        res["cpu_payload_resent_ok"] = bool(getattr(ans, "success", True))
        log(f"the CPU payload sent a second time: {'accepted' if res['cpu_payload_resent_ok'] else 'REFUSED'}")
        write_json(args.json, res)
    finally:
        engine.shutdown()
    return res


def sglang_table(res: dict) -> str:
    """The configs' tok/s and ratios to ``off``, then the adapter syncs' median rate."""
    text = ratio_table(res, {})
    if res["syncs"]:
        med = statistics.median
        ok = "all accepted" if all(s["ok"] for s in res["syncs"]) else "NOT all accepted"
        text += (
            f"\n\nAdapter sync into the live engine (`load_lora_adapter_from_tensors`, flattened bucket): "
            f"{med(s['gb_s'] for s in res['syncs']):.2f} GB/s (median of {len(res['syncs'])}, "
            f"{res['syncs'][0]['bytes'] / 2**20:.0f} MiB as CUDA-IPC handles; bucketing + serializing "
            f"{med(s['build_s'] for s in res['syncs']):.2f} s of it; {ok})"
        )
    return text


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="engine", required=True)
    for name in ("vllm", "sglang"):
        p = sub.add_parser(name, help=f"the {name} slice")
        p.add_argument("--workdir", default=f"/tmp/kimi_{name}_bench")
        p.add_argument("--json", help="write the raw numbers here (after every phase)")
        p.add_argument("--vocab", type=int, default=32768, help="vocabulary of the slice (the releases have 163840)")
        p.add_argument(
            "--budget-s",
            type=float,
            default=420.0,
            help="seconds from the start after which no new phase / repeat / load begins",
        )
    v, s = sub.choices["vllm"], sub.choices["sglang"]
    v.add_argument("--tiny", action="store_true", help="make-tiny K2 sizes on the CPU engine (checks the script)")
    v.add_argument(
        "--layers",
        type=int,
        default=2,
        help="decoder layers, 2..6 (1 dense + layers-1 MoE; each K2 MoE layer is 9.5 GB on disk)",
    )
    v.add_argument("--phases", default=",".join(VLLM_PHASES), help=f"comma list of {','.join(VLLM_PHASES)}")
    v.add_argument("--repeats", type=int, default=3)
    v.add_argument("--hot-loads", type=int, default=3)
    v.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    v.add_argument(
        "--no-lora",
        action="store_true",
        help="control run: engine without enable_lora (only the 'off' phase is measured)",
    )
    v.add_argument(
        "--stack-dump-after",
        type=float,
        default=0.0,
        help="every N s, dump every thread's stack to --stack-file (engine in this process: "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0); finds where a slow engine start waits",
    )
    v.add_argument("--stack-file", help="where --stack-dump-after writes (default WORKDIR/stacks.txt)")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--syncs", type=int, default=3)
    s.add_argument("--print-config", action="store_true", help="print the slice's config and exit (no GPU)")
    args = ap.parse_args(argv)
    global TAG
    TAG = args.engine
    if args.engine == "sglang":
        if args.print_config:
            print(json.dumps(sglang_slice_config(args.vocab), indent=1))
            return
        os.environ.setdefault("SGLANG_PLUGINS", "kimi")
        res = measure_sglang(args)
        write_json(args.json, res)
        print(sglang_table(res))
        return
    if args.stack_dump_after:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    phases = ["off"] if args.no_lora else [p for p in args.phases.split(",") if p]
    if bad := [p for p in phases if p not in VLLM_PHASES]:
        sys.exit(f"--phases {args.phases}: unknown {bad}; expected a comma list of {VLLM_PHASES}")
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    res = measure_vllm(args, phases)
    print(vllm_table(res))
    print("engine log lines kept:", *(ln[:240] for ln in res["engine_log"][:40]), sep="\n  ", flush=True)
    if not res["engine_paths"]["moe_method"] and not res["tiny"]:
        print("WARNING: no MoE method line found in vLLM's log", flush=True)


if __name__ == "__main__":
    main()
