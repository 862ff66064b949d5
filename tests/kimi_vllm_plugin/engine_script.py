"""Runs one real vLLM CPU engine through the plugin and records what the tests check (JSON).

Started by the tests in a subprocess (vLLM forks workers; the ``__main__`` guard is required).
``plan.json`` lists prompts and an ordered list of steps::

    {"ckpt": DIR, "max_lora_rank": 16, "enable_lora": true, "prompts": [[ids...], ...],
     "engine_kwargs": {"language_model_only": true},   # optional, passed to vllm.LLM
     "steps": [{"kind": "base"}, {"kind": "load", "path": DIR, "tag": "A"}, {"kind": "score", "tag": "A"}, ...]}

``load`` goes through :class:`kimi_vllm_plugin.client.KimiLoraClient`; ``score`` records prompt
logprobs of every prompt with the current adapter (prompt 0 also without, in the same batch);
``raw_load`` hands a directory to vLLM directly (no client validation); ``model_info`` records what
the worker built (:func:`model_info`; needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

import json
import os
import sys
import time

from worker_probe import model_info  # importable by name in the workers (a __main__ function is not)


def prompt_lps(out, ids):
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]


def main(plan_path: str, out_path: str) -> None:
    plan = json.load(open(plan_path))
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from kimi_vllm_plugin.client import AdapterRejected, KimiLoraClient

    kw = dict(enable_lora=True, max_lora_rank=plan["max_lora_rank"], max_loras=2) if plan.get("enable_lora") else {}
    llm = LLM(model=plan["ckpt"], skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05,
              max_model_len=128, max_num_seqs=4, dtype=plan.get("dtype", "bfloat16"), seed=0, **kw, **plan.get("engine_kwargs", {}))
    res = {"start_s": time.time() - t0, "steps": []}
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in plan["prompts"]]
    t1 = time.time()
    first = llm.generate(prompts[:1], sp)
    res["first_generate_s"] = time.time() - t1
    res["first_tokens"] = list(first[0].outputs[0].token_ids)
    client = KimiLoraClient.offline(llm, plan["ckpt"], max_lora_rank=plan["max_lora_rank"],
                                    stage_dir=plan["stage_dir"]) if plan.get("enable_lora") else None
    next_raw_id = 1000
    for step in plan["steps"]:
        rec = {"kind": step["kind"], "tag": step.get("tag")}
        try:
            if step["kind"] == "base":
                outs = llm.generate(prompts, sp)
                rec["lps"] = [prompt_lps(o, p) for o, p in zip(outs, plan["prompts"])]
                rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            elif step["kind"] == "load":
                req = client.load(step["path"])
                rec["ok"], rec["name"] = True, req.lora_name
            elif step["kind"] == "model_info":
                rec.update(llm.apply_model(model_info)[0])
            elif step["kind"] == "raw_load":
                next_raw_id += 1
                ok = llm.llm_engine.add_lora(LoRARequest(f"raw-{next_raw_id}", next_raw_id, step["path"]))
                rec["ok"] = bool(ok)
            elif step["kind"] == "score":
                req = client.current
                # all prompts with the adapter plus prompt 0 without it, in one batch (per-token slots)
                outs = llm.generate(prompts + prompts[:1], sp, lora_request=[req] * len(prompts) + [None])
                rec["lps"] = [prompt_lps(o, p) for o, p in zip(outs, plan["prompts"] + plan["prompts"][:1])]
                rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
                rec["name"] = req.lora_name
        except AdapterRejected as e:
            rec["ok"], rec["error"], rec["error_type"] = False, str(e), "AdapterRejected"
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            rec["ok"], rec["error"], rec["error_type"] = False, f"{type(e).__name__}: {e}", type(e).__name__
        res["steps"].append(rec)
    res["total_s"] = time.time() - t0
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
