"""Step 0 of a SkyRL run against ``kimi_core.reference`` on the same tokens: the bf16 floor of the run.

Usage: ``python3 tools/gpu/skyrl_floor.py CKPT ROLLOUTS_JSON OUT_JSON`` (GPU machine, after
``tools/gpu/skyrl_loop.sh``; ROLLOUTS_JSON is what ``KIMI_SKYRL_DUMP_ROLLOUTS`` made our SkyRL trainer write:
step 0's prompt and response token ids and vLLM's logprobs of the sampled tokens).

On every response token it computes ``log p`` with the reference in fp32 and in bf16 and reports the mean
``|dlogprob|`` of: the bf16 reference vs the fp32 reference (the model's own bf16 error on these tokens, the floor
every bf16 engine sits on) and vLLM vs the fp32 reference. SkyRL's own step-0
``policy/rollout_train_logprobs_abs_diff_mean`` (its Megatron trainer vs vLLM) is judged against that floor by
``tools/gpu/skyrl_loop_check.py``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kimi_core.reference import load_reference_model


def response_logprobs(model, prompt: list[int], response: list[int], device: str) -> torch.Tensor:
    """``[len(response)]`` fp32 logprobs of ``response`` after ``prompt``."""
    ids = torch.tensor([prompt + response], device=device)
    lp = model.logprobs(ids[:, :-1], ids[:, 1:])[0]
    return lp[len(prompt) - 1 :].float().cpu()


def main(ckpt: str, rollouts: str, out: str) -> dict:
    data = json.load(open(rollouts))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {dt: load_reference_model(ckpt, dtype=dt, device=device) for dt in (torch.float32, torch.bfloat16)}
    d_floor, d_engine, n = 0.0, 0.0, 0
    with torch.no_grad():
        for prompt, resp, engine in zip(data["prompt_token_ids"], data["response_ids"], data["rollout_logprobs"]):
            if not resp or engine is None:
                continue
            lp32 = response_logprobs(models[torch.float32], list(prompt), list(resp), device)
            lp16 = response_logprobs(models[torch.bfloat16], list(prompt), list(resp), device)
            eng = torch.tensor(engine[: len(resp)], dtype=torch.float32)
            d_floor += (lp16 - lp32).abs().sum().item()
            d_engine += (eng - lp32).abs().sum().item()
            n += len(resp)
    summary = {
        "tokens": n,
        "sequences": len(data["response_ids"]),
        "reference_bf16_vs_fp32_mean": d_floor / max(n, 1),
        "vllm_vs_reference_fp32_mean": d_engine / max(n, 1),
    }
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, out)
    print("floor:", json.dumps(summary))
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
