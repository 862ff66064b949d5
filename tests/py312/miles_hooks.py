"""Checks of our hooks called by miles' own code, run in miles_lane's child process (fork Megatron-LM first on
the path). Each takes the JSON payload the test sends and returns what the test asserts on.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from miles_lane import parse_miles_args


class FakeSGLang:
    """SGLang's ``/generate`` on 127.0.0.1, answering in SGLang 0.5.17's JSON shape.

    For ``n_new`` generated tokens it draws ``logits [n_new, V]`` (float64, seeded), samples each token
    from ``softmax(logits / T)`` (``T`` the request's ``sampling_params.temperature``) and answers with
    ``meta_info.output_token_logprobs`` (``[logprob, id, None]`` per token) and, when the request set
    ``top_logprobs_num`` = K, ``meta_info.output_top_logprobs`` (per token the K most likely
    ``[logprob, id, None]``, most likely first; ``TokenizerManager.detokenize_top_logprobs_tokens`` with
    ``return_text_in_logprobs`` false). ``drop_top`` answers ``None`` rows instead, as SGLang does for a
    position where it computed no top-K.
    """

    def __init__(self, vocab: int, n_new: int, text: str, seed: int, drop_top: bool = False):
        self.vocab, self.n_new, self.text, self.seed, self.drop_top = vocab, n_new, text, seed, drop_top
        self.requests: list[dict] = []
        self.logits: list[list[list[float]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                out = json.dumps(fake.answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def answer(self, req: dict) -> dict:
        self.requests.append(req)
        g = torch.Generator().manual_seed(self.seed + len(self.requests))
        logits = 3 * torch.randn(self.n_new, self.vocab, generator=g, dtype=torch.float64)
        self.logits.append(logits.tolist())
        temp = float(req["sampling_params"].get("temperature", 1.0))
        lp = torch.log_softmax(logits / temp, dim=-1)
        tokens = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        meta = {
            "id": f"req-{len(self.requests)}",
            "finish_reason": {"type": "length", "length": self.n_new},
            "prompt_tokens": len(req["input_ids"]),
            "completion_tokens": self.n_new,
            "cached_tokens": 0,
            "weight_version": "default",
            "output_token_logprobs": [[lp[i, t].item(), int(t), None] for i, t in enumerate(tokens.tolist())],
        }
        k = int(req.get("top_logprobs_num") or 0)
        if k:
            vals, ids = lp.topk(k, dim=-1)
            rows = [[[v, i, None] for v, i in zip(vr, ir, strict=True)] for vr, ir in zip(vals.tolist(), ids.tolist())]
            meta["output_top_logprobs"] = [None] * self.n_new if self.drop_top else rows
        return {"text": self.text, "output_ids": tokens.tolist(), "meta_info": meta}

    def close(self) -> None:
        self.server.shutdown()


def check_topk_rollout(payload: dict) -> dict:
    """miles' rollout step for one sample (``inference_rollout_common.generate_and_rm``: our generate function
    from ``--custom-generate-function-path``, then the reward from ``--custom-rm-path`` through miles'
    ``async_rm``) against a :class:`FakeSGLang` per entry of ``payload["servers"]`` (its keyword
    arguments); returns, per server, the sample's fields, the requests and the logits, or the error."""
    os.environ.update(payload["env"])
    args = parse_miles_args(payload["argv"])
    from miles.rollout.inference_rollout.inference_rollout_common import GenerateState, generate_and_rm
    from miles.utils import http_utils
    from miles.utils.types import Sample

    args.sglang_router_ip = "127.0.0.1"
    http_utils.init_http_client(args)
    state = GenerateState(args)
    out = []
    for server in payload["servers"]:
        fake = FakeSGLang(**server)
        args.sglang_router_port = fake.port
        sample = Sample(index=0, prompt=payload["prompt"], label=payload["label"])
        try:
            sample = asyncio.run(generate_and_rm(state, sample, dict(state.sampling_params)))
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}", "requests": fake.requests})
            continue
        finally:
            fake.close()
        out.append(
            {
                "temperature": args.rollout_temperature,
                "k": args.rollout_top_logprobs_num,
                "requests": fake.requests,
                "logits": fake.logits,
                "tokens": sample.tokens,
                "response_length": sample.response_length,
                "rollout_log_probs": sample.rollout_log_probs,
                "rollout_topk_token_ids": getattr(sample, "rollout_topk_token_ids", None),
                "rollout_topk_log_probs": getattr(sample, "rollout_topk_log_probs", None),
                "reward": sample.reward,
            }
        )
    return {"runs": out}


CHECKS = {"topk_rollout": check_topk_rollout}


def _outcome(fn):
    try:
        return {"ok": fn()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def check_train_hooks(payload: dict) -> dict:
    """In a 1-rank gloo world with Megatron's model-parallel state up: miles' ``--custom-megatron-init-path``
    loader on our init, then miles' LoRA resolver and ``wrap_model_provider_with_lora`` around miles' own
    model provider (``--spec``), building the actor chunk as ``setup_model_and_optimizer`` does."""
    os.environ.update(payload["env"])
    args = parse_miles_args(payload["argv"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(payload["port"]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    from miles.utils.misc import load_function

    out = {"init_target": None}
    init = load_function(args.custom_megatron_init_path)
    out["init_target"] = f"{init.__module__}.{init.__qualname__}"
    out["init"] = _outcome(lambda: _jsonable(init(args)))

    def build():
        from miles.backends.megatron_utils.lora_utils import resolve_lora_provider
        from miles.backends.megatron_utils.model_provider import get_model_provider_func

        module = resolve_lora_provider(args)
        provider = module.wrap_model_provider_with_lora(get_model_provider_func(args, "actor"), args)
        model = provider(pre_process=True, post_process=True, vp_stage=None)
        lora = [n for n, p in model.named_parameters() if p.requires_grad]
        return {"provider": module.__name__, "model": type(model).__name__, "trainable": len(lora)}

    from miles.backends.megatron_utils.lora_utils import resolve_lora_provider

    out["lora_provider_module"] = _outcome(lambda: resolve_lora_provider(args).__name__)
    out["provider"] = _outcome(build)
    return out


def _jsonable(v):
    return json.loads(json.dumps(v, default=repr))


CHECKS["train_hooks"] = check_train_hooks
