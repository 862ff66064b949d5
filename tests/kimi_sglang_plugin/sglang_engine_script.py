"""Runs one offline SGLang engine (``sgl.Engine``) and records the prompt logprobs the GPU tests check (JSON).

Started by :func:`sglang_engine_harness.run_engine` in a subprocess with ``SGLANG_PLUGINS`` set
(``none`` for stock SGLang, ``kimi`` for the plugin); the ``__main__`` guard is required because the
engine spawns its scheduler. ``plan.json``::

    {"ckpt": DIR, "prompts": [[ids...], ...], "engine_kwargs": {...ServerArgs fields...}}

Prompt logprobs come from ``Engine.generate(input_ids=..., return_logprob=True, logprob_start_len=0)``
(0.5.17 ``entrypoints/engine.py:343``): ``meta_info["input_token_logprobs"]`` holds ``(logprob, id, text)``
per prompt token. Python logging is configured at INFO before the engine starts so that this
process's plugin registration line reaches the log (SGLang configures logging only later).
"""

import json
import logging
import sys
import time


def main(plan_path: str, out_path: str) -> None:
    plan = json.load(open(plan_path))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from sglang_engine_harness import prompt_logprobs

    t0 = time.time()
    import sglang as sgl

    engine = sgl.Engine(model_path=plan["ckpt"], **plan["engine_kwargs"])
    res = {"start_s": time.time() - t0}
    try:
        t1 = time.time()
        outs = engine.generate(input_ids=plan["prompts"], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               return_logprob=True, logprob_start_len=0)
        res["generate_s"] = time.time() - t1
        res["lps"] = [prompt_logprobs(o["meta_info"], p) for o, p in zip(outs, plan["prompts"])]
        try:  # informative only: the tests assert from the log
            info = engine.get_server_info()
            res["server_info"] = {k: info.get(k) for k in ("attention_backend", "moe_runner_backend", "dtype", "version")}
        except Exception as e:  # noqa: BLE001
            res["server_info"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        engine.shutdown()
    json.dump(res, open(out_path, "w"))


if __name__ == "__main__":  # run as a script, so this folder (the harness) is sys.path[0]
    main(sys.argv[1], sys.argv[2])
