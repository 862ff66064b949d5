"""``kimi-rl demo`` (``make demo``): the main job on one CPU machine.

Until the full LoRA-RL loop lands (trainer + vLLM engine + adapter sync), the demo runs the most
complete end-to-end path that exists and says what it did: write a tiny K2.x checkpoint with
INT4 experts, write verified BF16 masters, and score sampled tokens with the reference model.
"""

from __future__ import annotations

import os
import time

import torch


def main(args) -> int:
    from kimi_core.checkpoint.dequantize import dequantize_checkpoint
    from kimi_core.checkpoint.tiny import make_tiny

    out = args.out
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    ckpt = make_tiny("k2", os.path.join(out, "tiny-k2-int4"), seed=args.seed)
    print(f"[1] tiny Kimi K2.x checkpoint with INT4 (Kimi QAT convention) experts: {ckpt}")
    rep = dequantize_checkpoint(ckpt, os.path.join(out, "tiny-k2-bf16"), progress=False)
    print(f"[2] BF16 masters: {rep.dequantized} expert tensors dequantized and verified as fixed points")
    try:
        from kimi_core.reference import load_reference_model
    except ImportError:
        print("[3] reference model not available yet; stopping here")
        return 0
    model = load_reference_model(ckpt)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=g)
    with torch.no_grad():
        for _ in range(16):
            probs = torch.softmax(model(ids)[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
        lp = model.logprobs(ids[:, :-1], ids[:, 1:])
    print(f"[3] reference model sampled 16 tokens: {ids[0, 8:].tolist()}; mean logprob {lp.mean():.3f}")
    print(f"done in {time.time() - t0:.1f}s. The LoRA-RL loop (issue: kimi_rl_glue demo) is not wired yet.")
    return 0
