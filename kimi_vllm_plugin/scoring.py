"""Score token sequences with a real vLLM engine through the plugin (prompt logprobs), in a subprocess.

``python -m kimi_vllm_plugin.scoring plan.json out.json`` where ``plan.json`` is
``{"ckpt", "ids": [[...], ...], "dtype": "bfloat16"|"float32", "adapter": DIR|null, "max_lora_rank"}``;
``out.json`` gets ``{"logprobs": [[...]], "top1": [[...]], "start_s"}`` with, for each sequence,
the logprob of token ``t+1`` and the engine's argmax at position ``t`` (``T-1`` entries). vLLM forks
workers, so this runs as its own process (the ``__main__`` guard is required).
"""

from __future__ import annotations

import json
import os
import sys
import time


def score(plan: dict) -> dict:
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    t0 = time.time()
    from vllm import LLM, SamplingParams

    from kimi_vllm_plugin.client import KimiLoraClient

    ids = plan["ids"]
    lora = dict(enable_lora=True, max_lora_rank=plan.get("max_lora_rank", 16), max_loras=1) if plan.get("adapter") else {}
    llm = LLM(model=plan["ckpt"], skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05,
              max_model_len=max(64, max(len(s) for s in ids) + 2), max_num_seqs=max(1, len(ids)),
              dtype=plan.get("dtype", "bfloat16"), seed=0, **lora)
    start_s = time.time() - t0
    req = None
    if plan.get("adapter"):
        client = KimiLoraClient.offline(llm, plan["ckpt"], max_lora_rank=plan.get("max_lora_rank", 16),
                                        stage_dir=plan["stage_dir"])
        req = client.load(plan["adapter"])
    outs = llm.generate([{"prompt_token_ids": s} for s in ids],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), lora_request=req,
                        use_tqdm=False)
    lps, top1 = [], []
    for o, s in zip(outs, ids):
        pl = o.prompt_logprobs[1:]
        lps.append([d[t].logprob for d, t in zip(pl, s[1:])])
        # prompt_logprobs[t + 1] is the distribution predicting token t + 1: its rank-1 entry is the argmax at t
        top1.append([next(k for k, v in d.items() if v.rank == 1) for d in pl])
    return {"logprobs": lps, "top1": top1, "start_s": start_s}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        res = score(json.load(f))
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, sys.argv[2])
