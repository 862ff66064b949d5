"""Score token sequences with a real vLLM engine through the plugin (prompt logprobs), in a subprocess.

``python -m kimi_vllm_plugin.scoring plan.json out.json`` where ``plan.json`` is
``{"ckpt", "ids": [[...], ...], "dtype": "bfloat16"|"float32", "adapter": DIR|null, "max_lora_rank",
"hidden": PATH|null}``; ``out.json`` gets ``{"logprobs": [[...]], "top1": [[...]], "start_s"}`` with,
for each sequence, the logprob of token ``t+1`` and the engine's argmax at position ``t`` (``T-1``
entries). With ``hidden``, each sequence is also run alone with :mod:`kimi_vllm_plugin.probe` armed and
``PATH`` (safetensors) gets ``"{b}.{k}"`` = the residual stream after layer ``k-1`` (``k=0``: the
embeddings), ``[T, H]``: what ``kimi-rl check-numerics`` uses to name the first diverging layer. vLLM
forks workers, so this runs as its own process (the ``__main__`` guard is required). GPU MLA backends
take bf16/fp16 only, so ``"float32"`` on a CUDA host is refused with that reason.
"""

from __future__ import annotations

import json
import os
import sys
import time


def score(plan: dict) -> dict:
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    if plan.get("hidden"):  # the probe ships functions to the worker (LLM.apply_model)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    t0 = time.time()
    import torch
    from vllm import LLM, SamplingParams

    if plan.get("dtype") == "float32" and torch.cuda.is_available():
        raise SystemExit(
            "kimi_vllm_plugin.scoring: dtype float32 is not servable on a GPU vLLM (its MLA backends "
            "take bf16/fp16 only); use --dtype bf16 (check-numerics then bounds it by the "
            "reference's own bf16 error)"
        )

    from kimi_vllm_plugin.client import KimiLoraClient
    from kimi_vllm_plugin.cpu_engine import cpu_engine_kwargs

    ids = plan["ids"]
    lora = (
        dict(enable_lora=True, max_lora_rank=plan.get("max_lora_rank", 16), max_loras=1) if plan.get("adapter") else {}
    )
    max_len, seqs = max(64, max(len(s) for s in ids) + 2), max(1, len(ids))
    dtype = plan.get("dtype", "bfloat16")
    llm = LLM(
        model=plan["ckpt"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_len,
        max_num_seqs=seqs,
        dtype=dtype,
        seed=0,
        **lora,
        **cpu_engine_kwargs(plan["ckpt"], max_len, seqs, dtype),
    )
    start_s = time.time() - t0
    req = None
    if plan.get("adapter"):
        client = KimiLoraClient.offline(
            llm, plan["ckpt"], max_lora_rank=plan.get("max_lora_rank", 16), stage_dir=plan["stage_dir"]
        )
        req = client.load(plan["adapter"])
    outs = llm.generate(
        [{"prompt_token_ids": s} for s in ids],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
        lora_request=req,
        use_tqdm=False,
    )
    lps, top1 = [], []
    for o, s in zip(outs, ids):
        pl = o.prompt_logprobs[1:]
        lps.append([d[t].logprob for d, t in zip(pl, s[1:])])
        # prompt_logprobs[t + 1] is the distribution predicting token t + 1: its rank-1 entry is the argmax at t
        top1.append([next(k for k, v in d.items() if v.rank == 1) for d in pl])
    if plan.get("hidden"):
        _write_hidden(llm, ids, req, plan["hidden"])
    return {"logprobs": lps, "top1": top1, "start_s": start_s}


def _write_hidden(llm, ids, req, path: str) -> None:
    """Per sequence: one probed prefill; writes ``{b}.{k}`` residual streams ``[T, H]`` to ``path``."""
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from kimi_vllm_plugin.probe import arm, collect

    out = {}
    for b, s in enumerate(ids):
        llm.apply_model(arm)
        llm.generate(
            [{"prompt_token_ids": s}], SamplingParams(max_tokens=1, temperature=0.0), lora_request=req, use_tqdm=False
        )
        caps = llm.apply_model(collect)[0]
        layers = sorted((int(k.split(".")[1]), v) for k, v in caps.items() if k.startswith("layer."))
        for k, v in enumerate([caps["embed"], *[v for _, v in layers]]):
            out[f"{b}.{k}"] = v.float().contiguous()
    save_file(out, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        res = score(json.load(f))
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, sys.argv[2])
