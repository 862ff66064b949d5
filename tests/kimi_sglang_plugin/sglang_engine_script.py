"""Runs one offline SGLang engine (``sgl.Engine``) and records the prompt logprobs the GPU tests check (JSON).

Started by :func:`sglang_engine_harness.run_engine` in a subprocess with ``SGLANG_PLUGINS`` set
(``none`` for stock SGLang, ``kimi`` for the plugin); the ``__main__`` guard is required because the
engine spawns its scheduler. ``plan.json``::

    {"ckpt": DIR, "prompts": [[ids...], ...], "engine_kwargs": {...ServerArgs fields...},
     "adapters": [{"name": N, "path": DIR}, ...],            # optional: Engine.load_lora_adapter from disk
     "score": [null, N, ...],                                 # optional: base (null) and adapters to score
     "tensor_versions": [{"name": N, "path": DIR, "flip": false, "layout": [tp, ep, E]}, ...],
                                                              # optional: CUDA-IPC style loads, scored after each
     "routed_experts": false}                                 # optional: base scoring also returns the experts
                                                              # each prompt token was routed to (needs
                                                              # enable_return_routed_experts in engine_kwargs)

Prompt logprobs come from ``Engine.generate(input_ids=..., return_logprob=True, logprob_start_len=0,
lora_path=...)`` (0.5.17 ``entrypoints/engine.py:343``): ``meta_info["input_token_logprobs"]`` holds
``(logprob, id, text)`` per prompt token. ``tensor_versions`` go through
:mod:`kimi_sglang_plugin.sync` (``load_lora_adapter_from_tensors``, ``flattened_bucket``, sha256
``expected_checksums``); ``flip`` flips one byte of the payload after its checksums were taken, which
the engine must refuse. Python logging is configured at INFO before the engine starts so that this
process's plugin registration line reaches the log (SGLang configures logging only later).
"""

import json
import logging
import sys
import time
import traceback

import torch


def _score(engine, prompts, lora, routed_shape=None):
    """Prompt logprobs of ``prompts`` (on adapter ``lora``); with ``routed_shape = (layers, k)`` also the experts
    SGLang routed each prompt token to (``return_routed_experts``), per prompt ``[T][layers][k]``."""
    from sglang_engine_harness import prompt_logprobs, routed_experts

    kw = {"lora_path": [lora] * len(prompts)} if lora else {}
    if routed_shape:
        kw["return_routed_experts"] = True
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
        **kw,
    )
    lps = [prompt_logprobs(o["meta_info"], p) for o, p in zip(outs, prompts)]
    if not routed_shape:
        return lps
    return lps, [routed_experts(o["meta_info"], len(p), *routed_shape) for o, p in zip(outs, prompts)]


def _tensor_version(engine, ckpt, version) -> dict:
    """Load one adapter version through the plugin's sync payload; returns what the engine answered."""
    from kimi_core.config import load_config
    from kimi_core.lora import Adapter
    from kimi_sglang_plugin.adapters import prepare_adapter
    from kimi_sglang_plugin.sync import RankLayout, StockSGLangBackend, build_payload

    cfg = load_config(ckpt)
    ad = prepare_adapter(Adapter.load(version["path"]), cfg)
    # on this process's GPU, as a colocated trainer holds its adapter: the payload carries CUDA-IPC handles
    tensors = {k: v.to("cuda") for k, v in ad.tensors.items()}
    tp, ep, experts = version.get("layout", [1, 1, 0])
    layout = RankLayout(tp, ep, experts)
    payload = build_payload(version["name"], tensors, ad.adapter_config, cfg, layout, filter_experts=False, sha256=True)
    if version.get("flip"):  # same checksums, one byte of one tensor changed in what is sent
        bad = dict(tensors)
        name = sorted(bad)[len(bad) // 2]
        raw = bad[name].detach().clone().contiguous().view(torch.uint8).view(-1)
        raw[raw.numel() // 2] ^= 0x40
        bad[name] = raw.view(tensors[name].dtype).view(tensors[name].shape)
        sent = build_payload(version["name"], bad, ad.adapter_config, cfg, layout, filter_experts=False)
        sent.expected_checksums = payload.expected_checksums
        payload = sent
    t0 = time.time()
    try:
        ans = StockSGLangBackend(engine=engine).load(payload, unload_first=False)
        ok = bool(getattr(ans, "success", True))
        msg = str(getattr(ans, "error_message", "") or "")
    except Exception as e:
        ok, msg = False, f"{type(e).__name__}: {e}"
    return {
        "name": version["name"],
        "ok": ok,
        "message": msg,
        "load_s": time.time() - t0,
        "nbytes": sum(b.nbytes for b in payload.buckets),
        "sent_from": str(payload.buckets[0].buffer.device),
    }


def main(plan_path: str, out_path: str) -> None:
    plan = json.load(open(plan_path))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    t0 = time.time()
    import sglang as sgl

    from kimi_core.config import load_config
    from kimi_sglang_plugin.adapters import prepare_adapter

    engine = sgl.Engine(model_path=plan["ckpt"], **plan["engine_kwargs"])
    res = {"start_s": time.time() - t0, "adapters": {}, "lps_by": {}, "versions": []}
    try:
        for a in plan.get("adapters", []):
            try:  # the adapter as SGLang serves it (kimi_sglang_plugin.adapters), next to the original
                prepared = prepare_adapter(a["path"], load_config(plan["ckpt"]), out_dir=a["path"] + ".sglang").source
                ans = engine.load_lora_adapter(a["name"], prepared)
                res["adapters"][a["name"]] = {
                    "ok": bool(getattr(ans, "success", True)),
                    "message": str(getattr(ans, "error_message", "") or ""),
                }
            except Exception as e:
                res["adapters"][a["name"]] = {"ok": False, "message": f"{type(e).__name__}: {e}"}
        shape = None
        if plan.get("routed_experts"):  # the engine's expert choices, for the reference to replay
            cfg = load_config(plan["ckpt"])
            shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
            res["routed_by"] = {}

        def rescore(lora):
            """{"name", "lps", "routed", "seconds"}: one scoring of the prompts on ``lora``, its routing beside it
            (None without routed_experts), so the refused-load check compares like with like."""
            t = time.time()
            out = _score(engine, plan["prompts"], lora, shape)
            lps, routed = out if shape else (out, None)
            return {"name": lora, "lps": lps, "routed": routed, "seconds": time.time() - t}

        def score(lora):
            """logprobs of the prompts on ``lora``; the routing goes to res["routed"] / res["routed_by"][lora]."""
            r = rescore(lora)
            if shape is not None:
                if lora is None:
                    res["routed"] = r["routed"]
                else:
                    res["routed_by"][lora] = r["routed"]
            return r["lps"]

        t1 = time.time()
        res["lps"] = score(None)
        res["generate_s"] = time.time() - t1
        for name in plan.get("score", []):
            if name is None:
                continue
            try:
                res["lps_by"][name] = score(name)
            except Exception as e:
                res["lps_by"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        for v in plan.get("tensor_versions", []):
            good = [r["name"] for r in res["versions"] if r["ok"]]
            if v.get("flip") and good:  # the last good version right before the bad load, scored as after it, twice:
                # the two say how far one re-scoring moves on its own (0 on a deterministic engine)
                res["last_good_before"] = rescore(good[-1])
                res["last_good_repeat"] = rescore(good[-1])
            rec = _tensor_version(engine, plan["ckpt"], v)
            try:
                rec["lps"] = score(v["name"]) if rec["ok"] else _score(engine, plan["prompts"], v["name"])
            except Exception as e:
                rec["lps"] = {"error": f"{type(e).__name__}: {e}"}
            res["versions"].append(rec)
        good = [v["name"] for v in res["versions"] if v["ok"]]
        if good:  # after every load (a refused one included) the last good version still serves
            res["last_good"] = rescore(good[-1])
        try:  # informative only: the tests assert from the log
            info = engine.get_server_info()
            res["server_info"] = {
                k: info.get(k) for k in ("attention_backend", "moe_runner_backend", "dtype", "version")
            }
        except Exception as e:
            res["server_info"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        engine.shutdown()
    json.dump(res, open(out_path, "w"))


if __name__ == "__main__":  # run as a script, so this folder (the harness) is sys.path[0]
    main(sys.argv[1], sys.argv[2])
