"""kimi_megatron_plugin on one GPU: tiny K3/K3.1 vs the reference, and a real-width K3 slice.

Parts (each in its own subprocess, with a time limit, so one hang or crash does not lose the rest):

``tiny``   tiny K3 and K3.1 (4 layers: KDA, NoPE gated MLA, K3.1 indexer, latent MoE, bank) built
           with the plugin on the installed megatron-core, forward + backward in bf16 and fp32,
           compared with ``kimi_core.reference`` (fp32, same device, same checkpoint): logits and
           every trainable parameter's gradient (reference gradients through its cached weights,
           mapped by ``kimi_megatron_plugin.mapping``). ``--kda reference`` runs the reference
           ``chunk_kda`` inside the plugin's KDA layers; ``--kda fla`` runs fla's ``chunk_kda``.
``slice``  real-width K3 slice: hidden 7168, 2 MoE layers (both MLA: NoPE, output gate, bank),
           112 local experts of true size (latent 3584, moe_intermediate 3072, top-16), MXFP4
           experts held as packed bytes (Triton W4A16), real vocab; forward + backward tokens/s,
           peak memory and expert bytes per parameter, and the check that no BF16 expert copy
           exists (static memory = packed bytes; peak - static at few tokens < one layer's BF16 copy).
``int4``   K2-size INT4 experts module alone (48 local experts = 384 / EP 8, 7168 -> 2048, top-8):
           bytes per parameter and forward + backward tokens/s.

Usage::

    python benchmarks/megatron_gpu.py --smoke                 # CPU, tiny sizes (checks the script)
    python benchmarks/megatron_gpu.py --section-out sec.md     # GPU; --no-append to skip RESULTS.md

Tolerances (relative RMS vs the fp32 reference): fp32 logits 1e-4 and every gradient 1e-3 with the
reference KDA, 5e-3 / 2e-2 with fla (TF32 dots). bf16: tiny random MoE models flip top-k choices
under bf16 noise, so a fixed bound means little; the bf16 bar is the reference's own bf16 error
(the reference run in bf16 vs fp32, per logits and per gradient tensor): Megatron's bf16 logits
error and the median over tensors of (its gradient error / the reference's) must be within 3x
(floors 1e-3); the worst tensor's ratio is reported (router and gate tensors see top-k flips).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from results import append, git_commit  # noqa: E402

TOL = {("fp32", "reference"): (1e-4, 1e-3), ("fp32", "fla"): (5e-3, 2e-2)}
BF16_FACTOR = 3.0


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    r, g = ref.detach().double().cpu(), got.detach().double().cpu()
    den = r.pow(2).mean().sqrt().item()
    num = (g - r).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def init_world(dev: str) -> None:
    from megatron.core import parallel_state as ps

    if dev == "cpu":
        from kimi_megatron_plugin import cpu_compat

        cpu_compat.apply_cpu_shims()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    if dev == "cuda":  # GPU weight init forks megatron's model-parallel CUDA RNG
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def force_kda(mode: str) -> None:
    """``reference``: the plugin's KDA layers call kimi_core's ``chunk_kda`` on any device."""
    from kimi_core.reference import kda as ref_kda
    from kimi_megatron_plugin import layers

    if mode == "reference":
        layers.KimiKDA._kernel = staticmethod(lambda q: ref_kda.chunk_kda)


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- tiny
def _reference_grads(path, ids, w, dev, dtype=torch.float32):
    """Reference logits and d(sum(logits * w))/d(weight) for every cached dense weight (HF names)."""
    from kimi_core.reference import load_reference_model

    # on the CPU: kimi_core/reference/mla.py builds its causal mask without a device (fails on CUDA)
    ids, w = ids.cpu(), w.cpu()
    ref = load_reference_model(path, dtype=dtype, device="cpu")
    with torch.no_grad():
        ref(ids)  # fills the weight cache
    cache = ref.weights._cache
    for t in cache.values():
        if t.is_floating_point():
            t.requires_grad_(True)
    logits = ref(ids)
    (logits.float() * w).sum().backward()
    grads = {}
    for key, t in cache.items():
        if t.grad is not None:
            name = key.rsplit("@", 1)[0]
            grads[name] = grads.get(name, 0) + t.grad.float()
    return logits.detach(), grads


def _megatron_run(path, ids, w, dtype, dev):
    from kimi_megatron_plugin import checkpoint, mapping, provider

    model = provider.build_model_from_hf(path, perform_initialization=False, params_dtype=dtype)
    checkpoint.load_hf_checkpoint(model, path)
    kimi = model.kimi_config
    pos = torch.arange(ids.shape[1], device=dev)[None].expand(ids.shape[0], -1)
    logits = model(ids, pos, attention_mask=None)
    (logits.float() * w).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        rule, m, local = mapping.match(name)
        layer = model.decoder.layers[local].layer_number - 1 if local is not None else None
        hf = mapping.hf_names(rule, m, kimi, layer)
        g = p.grad.detach().float()
        if rule.split == "glu":
            for n, part in zip(hf, g.chunk(2, dim=0)):
                grads[n] = (part, None)
        else:
            grads[hf[0]] = (g, rule.hook)
    return logits.detach(), grads, kimi


def part_tiny(args, dev) -> list[dict]:
    from kimi_core.checkpoint.tiny import make_tiny

    init_world(dev)
    force_kda(args.kda)
    rows = []
    B, T = 2, 32
    for fam in ("k3", "k31"):
        path = make_tiny(fam, tempfile.mkdtemp(prefix=f"tiny_{fam}_"), layers=4)
        from kimi_core.config import load_config

        vocab = load_config(path).vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (B, T), generator=g).to(dev)
        w = torch.randn(B, T, vocab, generator=g).to(dev)
        t0 = time.time()
        ref_logits, ref_grads = _reference_grads(path, ids, w, dev)
        t_ref = time.time() - t0
        # bf16 noise floor: the reference itself in bf16 vs fp32 (MoE top-k flips included)
        rb_logits, rb_grads = _reference_grads(path, ids, w, dev, torch.bfloat16)
        floor_logits = rel(ref_logits, rb_logits.float())
        floor = {n: rel(ref_grads[n], g) for n, g in rb_grads.items() if n in ref_grads}
        for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            t0 = time.time()
            logits, grads, kimi = _megatron_run(path, ids, w, dtype, dev)
            sync(dev)
            t_meg = time.time() - t0
            lerr = rel(ref_logits, logits.float())
            worst, worst_name, missing = 0.0, "", []
            ratio, ratio_name, ratios = 0.0, "", []
            for name, (gm, hook) in grads.items():
                gr = ref_grads.get(name)
                if gr is None:
                    missing.append(name)
                    continue
                if hook == "a_log":
                    gr = gr.reshape(-1)[: gm.numel()].reshape(gm.shape)
                e = rel(gr.reshape(gm.shape), gm)
                if e > worst:
                    worst, worst_name = e, name
                fl = floor.get(name, 0.0)
                ratios.append(e / max(fl, 1e-3))
                if e / max(fl, 1e-3) > ratio:
                    ratio, ratio_name = e / max(fl, 1e-3), name
            if dname == "bf16":  # stated bf16 tolerance: within BF16_FACTOR x the reference's own bf16 error
                tl, tg = BF16_FACTOR * max(floor_logits, 1e-3), BF16_FACTOR
                med = sorted(ratios)[len(ratios) // 2]
                ok = lerr <= tl and med <= tg and not missing
            else:
                tl, tg = TOL[(dname, args.kda)]
                ok = lerr <= tl and worst <= tg and not missing
            rows.append({"part": "tiny", "model": fam, "dtype": dname, "kda": args.kda, "logits_rel": lerr,
                         "floor_logits": floor_logits, "median_ratio_to_floor": sorted(ratios)[len(ratios) // 2], "worst_ratio_to_floor": ratio, "worst_ratio_tensor": ratio_name,
                         "ok": ok,
                         "grads_checked": len(grads) - len(missing), "grads_missing": missing,
                         "grad_worst_rel": worst, "grad_worst": worst_name, "tol_logits": tl, "tol_grads": tg,
                         "s_megatron": t_meg, "s_reference": t_ref})
            print(json.dumps(rows[-1]), flush=True)
            del grads
    return rows


# ---------------------------------------------------------------------------------------------- slice
def _slice_config(smoke: bool) -> dict:
    from kimi_core.release_configs import k3_release_config

    cfg = k3_release_config()
    t = cfg["text_config"]
    t.update(num_hidden_layers=2, num_experts=112, first_k_dense_replace=0)
    t["linear_attn_config"].update(full_attn_layers=[1, 2], kda_layers=[])
    if smoke:
        t.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_token=4,
                 moe_intermediate_size=128, routed_expert_hidden_size=128, intermediate_size=512, vocab_size=1024)
        t["linear_attn_config"].update(num_heads=4, head_dim=32)
    return cfg


def _expert_weights(model) -> list[torch.Tensor]:
    """The routed experts' bf16 weight parameters (``dense`` / ``qat`` modes; none in ``w4a16``)."""
    return [p for n, p in model.named_parameters() if ".experts." in n and n.endswith("_weight")]


def _fill_experts(model, fmt_int4: bool = False) -> None:
    """Random codes and scales in the packed buffers (scales near 2^-6 so activations stay O(1)); bf16 expert
    weights (the dense baseline) of the same magnitude."""
    torch.manual_seed(0)
    for p in _expert_weights(model):
        p.copy_(torch.randn_like(p) * 0.03)
    for name, b in model.named_buffers():
        d = dict(device=b.device)
        if name.endswith("_packed"):
            if b.dtype == torch.uint8:
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, **d))
            else:
                b.copy_(torch.randint(-2**31, 2**31 - 1, b.shape, dtype=torch.int64, **d).to(torch.int32))
        elif name.endswith("_scale"):
            if b.dtype == torch.uint8:  # E8M0
                b.copy_(torch.randint(119, 123, b.shape, dtype=torch.uint8, **d))
            else:
                b.copy_((torch.rand(b.shape, **d) * 0.004 + 0.002).to(b.dtype))


def _expert_bytes(module) -> tuple[int, int]:
    """(bytes of packed weights + scales, logical expert parameters) under ``module``."""
    from kimi_megatron_plugin.experts import KimiExperts

    nbytes = params = 0
    for m in module.modules():
        if isinstance(m, KimiExperts):
            for p, (o, i) in m.shapes.items():
                held = ("packed", "scale") if m.mode == "w4a16" else ("weight",)
                nbytes += sum(getattr(m, f"{p}_{k}").numel() * getattr(m, f"{p}_{k}").element_size() for k in held)
                params += m.E * o * i
    return nbytes, params


def _timed(step, dev, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync(dev)
    return (time.perf_counter() - t0) / iters


def part_slice(args, dev, expert_mode: str = "w4a16", label: str | None = None) -> list[dict]:
    """The real-width slice with MXFP4 experts (``w4a16``: packed bytes) or, as the BF16 baseline, the same experts
    as frozen bf16 tensors (``dense``: one ``torch._grouped_mm`` per projection); the rest of the model trains.
    ``label``: the rows' ``experts`` column (default by ``expert_mode``)."""
    label = label or ("MXFP4 (W4A16)" if expert_mode == "w4a16" else "BF16 (grouped_mm)")
    from kimi_core.config import KimiConfig
    from kimi_megatron_plugin import provider
    from kimi_megatron_plugin.experts import KimiExperts

    init_world(dev)
    force_kda("reference")
    kimi = KimiConfig.from_hf(_slice_config(args.smoke), "slice config")
    cfg = provider.transformer_config(kimi, params_dtype=torch.bfloat16, num_layers=2)
    if dev == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    model = provider.build_model(kimi, cfg, expert_mode=expert_mode)
    with torch.no_grad():
        _fill_experts(model)
    for p in _expert_weights(model):  # frozen like the packed bytes: LoRA RL trains adapters, not the base experts
        p.requires_grad_(False)
    sync(dev)
    static = (torch.cuda.memory_allocated() - base) if dev == "cuda" else 0
    exp_bytes, exp_params = _expert_bytes(model)
    other = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + sum(
        b.numel() * b.element_size() for n, b in model.named_buffers()
        if not n.endswith(("_packed", "_scale")))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    bf16_experts_layer = exp_params * 2 // kimi.num_hidden_layers  # BF16 bytes of one layer's experts
    # no floating-point tensor of expert shape anywhere in the model (w4a16)
    exp_shapes = set()
    for m in model.modules():
        if isinstance(m, KimiExperts):
            exp_shapes |= {(m.E, o, i) for o, i in m.shapes.values()}
    bf16_copies = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                   if t.is_floating_point() and tuple(t.shape) in exp_shapes]
    rows = []
    vocab = kimi.vocab_size
    seqs = [(1, 64), (1, 1024), (1, 4096)] if not args.smoke else [(1, 16), (1, 64)]
    for B, S in seqs:
        ids = torch.randint(0, vocab, (B, S), device=dev)
        pos = torch.arange(S, device=dev)[None].expand(B, -1)

        def step():
            model.zero_grad(set_to_none=True)
            out = model(ids, pos, attention_mask=None)
            out.float().square().mean().backward()

        # short steps are host-bound and vary run to run (1 x 64: 24-42 ms for one commit, H100, 2026-12-06 with 5
        # steps after 2 warm-ups): time 20 after 3 there
        iters, warmup = (1, 1) if args.smoke else ((20, 3) if B * S <= 256 else (5, 2))
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sec = _timed(step, dev, iters, warmup)
        peak = torch.cuda.max_memory_allocated() - base if dev == "cuda" else 0
        with torch.no_grad():
            fsec = _timed(lambda: model(ids, pos, attention_mask=None), dev, iters, warmup)
        rows.append({"part": "slice", "experts": label,
                     "B": B, "S": S, "tokens": B * S, "fwd_bwd_ms": sec * 1e3,
                     "fwd_ms": fsec * 1e3, "tok_s_fwd_bwd": B * S / sec, "tok_s_fwd": B * S / fsec,
                     "static_GiB": static / 2**30, "peak_GiB": peak / 2**30,
                     "peak_minus_static_GiB": (peak - static) / 2**30, "grads_GiB": grad_bytes / 2**30,
                     "expert_packed_GiB": exp_bytes / 2**30, "expert_params_B": exp_params / 1e9,
                     "expert_B_per_param": exp_bytes / exp_params,
                     "dense_params_and_buffers_GiB": other / 2**30,
                     "bf16_expert_copy_per_layer_GiB": bf16_experts_layer / 2**30,
                     "bf16_expert_tensors_in_model": bf16_copies, "hidden": kimi.hidden_size,
                     "experts_local": kimi.n_routed_experts, "topk": kimi.num_experts_per_tok})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def part_int4(args, dev) -> list[dict]:
    from kimi_core.config import KimiConfig
    from kimi_core.release_configs import k2_release_config
    from kimi_megatron_plugin import provider
    from kimi_megatron_plugin.experts import KimiExperts

    init_world(dev)
    c = k2_release_config()
    c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                          "group_size": 32, "symmetric": True}}},
                                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
    E = 48
    if args.smoke:
        c.update(hidden_size=256, moe_intermediate_size=128)
        E = 8
    c["n_routed_experts"] = E
    kimi = KimiConfig.from_hf(c, "k2 int4 config")
    cfg = provider.transformer_config(kimi, params_dtype=torch.bfloat16, num_layers=2)
    if dev == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    ex = KimiExperts(E, cfg, kimi=kimi, mode="w4a16")
    with torch.no_grad():
        _fill_experts(ex)
    sync(dev)
    static = (torch.cuda.memory_allocated() - base) if dev == "cuda" else 0
    nb, npar = _expert_bytes(ex)
    rows = []
    for T in ([64, 4096] if not args.smoke else [16]):
        topk = kimi.num_experts_per_tok
        rowsn = T * topk
        split = [rowsn // E + (1 if i < rowsn % E else 0) for i in range(E)]
        x = torch.randn(rowsn, kimi.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(rowsn, device=dev)
        tpe = torch.tensor(split)

        def step():
            x.grad = None
            y, _ = ex(x, tpe, probs)
            y.float().square().mean().backward()

        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sec = _timed(step, dev, 1 if args.smoke else 10, 1 if args.smoke else 2)
        peak = torch.cuda.max_memory_allocated() - base if dev == "cuda" else 0
        rows.append({"part": "int4", "tokens": T, "rows": rowsn, "E": E, "fwd_bwd_ms": sec * 1e3,
                     "tok_s_fwd_bwd": T / sec, "expert_B_per_param": nb / npar, "expert_params_B": npar / 1e9,
                     "static_GiB": static / 2**30, "packed_GiB": nb / 2**30, "peak_GiB": peak / 2**30,
                     "bf16_copy_GiB": npar * 2 / 2**30})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def part_slice_bf16(args, dev) -> list[dict]:
    return part_slice(args, dev, expert_mode="dense")


def part_slice_gluon(args, dev) -> list[dict]:
    """The W4A16 slice with every expert GEMM (forward, recompute, dgrad) forced to the experimental Gluon kernel
    (``KIMI_W4A16_PATH=gluon``; this part runs in its own process)."""
    from kimi_core import kernels

    os.environ[kernels.PATH_ENV] = "gluon"
    return part_slice(args, dev, label="MXFP4 (W4A16, Gluon kernel)")


PARTS = {"tiny": part_tiny, "slice": part_slice, "slice-bf16": part_slice_bf16, "slice-gluon": part_slice_gluon,
         "int4": part_int4}


# ---------------------------------------------------------------------------------------------- driver
def run_part(name: str, extra: list[str], timeout: float, smoke: bool) -> tuple[list[dict], str]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--json", out, *extra] + (["--smoke"] if smoke else [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        status = f"rc={p.returncode}"
        log = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timeout after {timeout:.0f} s"
        log = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace") \
            if isinstance(e.stdout, bytes) or e.stdout is None else (e.stdout or "") + (e.stderr or "")
    rows = []
    if os.path.exists(out) and os.path.getsize(out):
        with open(out) as f:
            rows = json.load(f)
    status += f", {time.time() - t0:.0f} s"
    tail = "\n".join(log.strip().splitlines()[-25:])
    print(f"== part {name} {' '.join(extra)}: {status}\n{tail}", flush=True)
    return rows, status


def env_line(dev: str) -> str:
    import megatron.core

    v = [f"torch {torch.__version__}", f"megatron-core {megatron.core.__version__}"]
    try:
        import triton

        v.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    try:
        import fla

        v.append(f"fla {fla.__version__}")
    except ImportError:
        pass
    gpu = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU"
    return gpu, ", ".join(v)


def table(rows: list[dict], statuses: dict) -> str:
    L = []
    tiny = [r for r in rows if r["part"] == "tiny"]
    if tiny:
        L += ["| model | dtype | KDA kernel | logits rel RMS (ref bf16 floor) | grads checked | worst grad rel RMS (tensor) | "
              "grad error / ref bf16 floor: median, worst (tensor) | tolerance | ok |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in tiny:
            tol = (f"logits {r['tol_logits']:.1e}, grads {r['tol_grads']:.0e}" if r["dtype"] == "fp32" else
                   f"logits <= {r['tol_logits']:.1e}, median grad ratio <= {r['tol_grads']:.0f}")
            L.append(f"| {r['model']} | {r['dtype']} | {r['kda']} | {r['logits_rel']:.2e} ({r['floor_logits']:.2e}) | "
                     f"{r['grads_checked']}{' (missing ' + str(len(r['grads_missing'])) + ')' if r['grads_missing'] else ''} | "
                     f"{r['grad_worst_rel']:.2e} (`{r['grad_worst'].split('model.')[-1]}`) | "
                     f"{r.get('median_ratio_to_floor', 0):.2f}, {r['worst_ratio_to_floor']:.2f} (`{r['worst_ratio_tensor'].split('model.')[-1]}`) | {tol} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
        L.append("")
    sl = [r for r in rows if r["part"] == "slice"]
    if sl:
        r0 = sl[0]
        L += [f"Real-width K3 slice: hidden {r0['hidden']}, 2 MLA+MoE layers, {r0['experts_local']} local experts "
              f"(top-{r0['topk']}), {r0['expert_params_B']:.2f} B expert params; the experts are frozen (LoRA RL "
              "trains adapters), the rest trains. A BF16 copy of one layer's experts would be "
              f"{r0['bf16_expert_copy_per_layer_GiB']:.2f} GiB.", ""]
        for k, r in enumerate(sl):
            if k == 0 or r.get("experts") != sl[k - 1].get("experts"):  # once per expert kind
                L.append(f"- {r.get('experts', 'MXFP4 (W4A16)')}: experts held in {r['expert_packed_GiB']:.2f} GiB "
                         f"= **{r['expert_B_per_param']:.4f} B/param**; trainable params + other buffers "
                         f"{r['dense_params_and_buffers_GiB']:.2f} GiB; static GPU memory after build "
                         f"{r['static_GiB']:.2f} GiB; floating-point tensors of expert shape: "
                         f"{len(r['bf16_expert_tensors_in_model']) or 'none'}")
        L += ["", "| experts | B x S | fwd+bwd ms | fwd+bwd tok/s | fwd ms | fwd tok/s | peak GiB | peak - static GiB "
              "| peak - static - dense grads GiB |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sl:
            L.append(f"| {r.get('experts', 'MXFP4 (W4A16)')} | {r['B']} x {r['S']} | {r['fwd_bwd_ms']:.1f} "
                     f"| {r['tok_s_fwd_bwd']:.0f} | {r['fwd_ms']:.1f} | {r['tok_s_fwd']:.0f} | {r['peak_GiB']:.2f} "
                     f"| {r['peak_minus_static_GiB']:.2f} | {r['peak_minus_static_GiB'] - r.get('grads_GiB', 0):.2f} |")
        bf = {r["S"]: r for r in sl if r.get("experts", "").startswith("BF16")}
        for label in dict.fromkeys(r.get("experts", "MXFP4 (W4A16)") for r in sl):  # each W4A16 kind vs BF16
            w4 = {r["S"]: r for r in sl if r.get("experts", "MXFP4 (W4A16)") == label}
            if label.startswith("MXFP4") and bf:
                L += ["", f"{label} vs BF16 experts, same slice: " + "; ".join(
                    f"S {S}: fwd+bwd {w4[S]['fwd_bwd_ms'] / bf[S]['fwd_bwd_ms']:.2f}x the BF16 time, static memory "
                    f"{w4[S]['static_GiB']:.2f} vs {bf[S]['static_GiB']:.2f} GiB" for S in sorted(w4) if S in bf)]
        L.append("")
    i4 = [r for r in rows if r["part"] == "int4"]
    if i4:
        L += ["| INT4 K2-size experts (module alone) | E | tokens (rows) | fwd+bwd ms | tok/s | B/param | packed GiB | static GiB | peak GiB | BF16 copy would be GiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in i4:
            L.append(f"| 7168 -> 2048, top-8 | {r['E']} | {r['tokens']} ({r['rows']}) | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['tok_s_fwd_bwd']:.0f} | {r['expert_B_per_param']:.4f} | {r['packed_GiB']:.3f} | "
                     f"{r['static_GiB']:.3f} | {r['peak_GiB']:.3f} | {r['bf16_copy_GiB']:.3f} |")
        L.append("")
    L.append("Part status: " + "; ".join(f"{k}: {v}" for k, v in statuses.items()))
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU allowed (checks the script)")
    ap.add_argument("--part", choices=sorted(PARTS), help="run one part in this process (internal)")
    ap.add_argument("--json", help="where --part writes its rows (internal)")
    ap.add_argument("--kda", choices=("reference", "fla"), default="reference")
    ap.add_argument("--fla-timeout", type=float, default=240.0, help="seconds for the fla chunk_kda tiny part")
    ap.add_argument("--part-timeout", type=float, default=240.0, help="seconds for each other part")
    ap.add_argument("--skip", default="",
                    help="comma list of parts to skip: tiny,tiny-fla,slice,slice-bf16,slice-gluon,int4")
    ap.add_argument("--section-out", help="also write the RESULTS.md section to this file")
    ap.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        sys.exit("benchmarks/megatron_gpu.py: no GPU; use --smoke for the CPU check of the script")
    if args.part:
        rows = PARTS[args.part](args, dev)
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return
    skip = set(filter(None, args.skip.split(",")))
    plan = [("slice", [], args.part_timeout), ("slice-bf16", [], args.part_timeout),
            ("slice-gluon", [], args.part_timeout), ("int4", [], args.part_timeout),
            ("tiny", ["--kda", "reference"], args.part_timeout), ("tiny", ["--kda", "fla"], args.fla_timeout)]
    rows, statuses = [], {}
    for name, extra, tmo in plan:
        key = name + ("-fla" if "fla" in extra else "")
        gpu_only = {"tiny-fla": " (fla needs a GPU)", "slice-gluon": " (the Gluon kernel needs a Hopper GPU)"}
        if key in skip or (key in gpu_only and dev == "cpu"):
            statuses[key] = "skipped" + (gpu_only[key] if key in gpu_only and dev == "cpu" else "")
            continue
        r, statuses[key] = run_part(name, extra, tmo, args.smoke)
        rows += r
        _write_section(args, _section(args, dev, rows, statuses))  # after every part: a later hang keeps these rows
    section = _section(args, dev, rows, statuses)  # with the statuses of parts skipped after the last one that ran
    _write_section(args, section)
    print(section)
    if not args.no_append and not args.smoke:
        append(section)


def _write_section(args, section: str) -> None:
    if args.section_out:
        with open(args.section_out, "w") as f:
            f.write(section)


def _section(args, dev, rows, statuses) -> str:
    gpu, versions = env_line(dev)
    commit = args.commit
    if commit is None:
        commit = git_commit()
    cmd = "python benchmarks/megatron_gpu.py " + " ".join(a for a in sys.argv[1:])
    section = (f"\n## kimi_megatron_plugin on GPU: tiny K3/K3.1 vs reference, real-width K3 slice "
               f"({datetime.date.today().isoformat()}, {gpu}{', SMOKE sizes' if args.smoke else ''})\n\n"
               f"- commit: {commit}\n- versions: {versions}\n- command: `{cmd.strip()}`\n\n" + table(rows, statuses) + "\n")
    return section


if __name__ == "__main__":
    main()
