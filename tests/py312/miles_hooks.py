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
        import traceback

        where = traceback.format_exception(e)[-9:-1]  # the innermost frames, for the test's failure message
        return {"error": f"{type(e).__name__}: {e}", "where": "".join(where)}


def check_train_hooks(payload: dict) -> dict:
    """In a 1-rank gloo world with Megatron's model-parallel state up: miles' ``--custom-megatron-init-path``
    loader on our init, then miles' LoRA resolver and ``wrap_model_provider_with_lora`` around miles' own
    model provider (``--spec``), building the actor chunk as ``setup_model_and_optimizer`` does."""
    os.environ.update(payload["env"])
    args = payload.get("args") or parse_miles_args(payload["argv"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(payload["port"]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    # miles' initialize seeds the model-parallel CUDA RNG (model_parallel_cuda_manual_seed); a CPU has none, so
    # megatron-core's no-op tracker stands in for it
    from kimi_megatron_plugin.cpu_parallel import cpu_rng_tracker

    cpu_rng_tracker()
    from miles.utils.misc import load_function

    out = {"init_target": None}
    init = load_function(args.custom_megatron_init_path)
    out["init_target"] = f"{init.__module__}.{init.__qualname__}"
    out["init"] = _outcome(lambda: _jsonable(init(args)))

    from miles.backends.megatron_utils.lora_utils import resolve_lora_provider

    out["lora_provider_module"] = _outcome(lambda: resolve_lora_provider(args).__name__)
    builds = payload.get("builds") or [{"family": "k31", "checkpoint": args.hf_checkpoint}]
    out["builds"] = {}
    for build in builds:
        b_args = args if "argv" not in build else _parsed(build)
        out["builds"][build["family"]] = _outcome(lambda a=b_args, b=build: _build_forward_backward(a, b, payload))
    return out


def _parsed(build: dict):
    saved = dict(os.environ)
    os.environ.update(build["env"])
    try:
        return parse_miles_args(build["argv"])
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cpu_fp32(args) -> None:
    """The parsed arguments this CPU check changes, each for a CPU reason: the alltoall dispatcher allocates a CUDA
    stream when it is built, so the allgather one (the same routing at EP 1), which refuses variable sequence
    lengths (one fixed micro-batch here); no activation recompute (megatron's CheckpointFunction saves the CUDA RNG
    state); fp32 parameters against the fp32 / float64 oracle (the GPU runs bf16)."""
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    args.moe_token_dispatcher_type = "allgather"
    args.variable_seq_lengths = False
    args.bf16 = False
    args.params_dtype = torch.float32


def _build_forward_backward(args, build: dict, payload: dict) -> dict:
    """miles' actor model provider (``--spec``) wrapped by the LoRA provider miles resolves, called as ``get_model``
    calls it; our HF loader fills the base (raw mode), a random adapter goes in through the provider's
    ``load_lora_adapter_hf``; one forward and backward of the next-token cross-entropy on seeded tokens, against
    kimi_core.reference in float64 with the same adapter file."""
    import tempfile

    from miles.backends.megatron_utils.lora_utils import resolve_lora_provider
    from miles.backends.megatron_utils.model_provider import get_model_provider_func

    from kimi_core.lora import random_adapter
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin.checkpoint import load_hf_checkpoint
    from kimi_megatron_plugin.lora.attach import lora_of

    _cpu_fp32(args)
    module = resolve_lora_provider(args)
    provider = module.wrap_model_provider_with_lora(get_model_provider_func(args, "actor"), args)
    model = provider(pre_process=True, post_process=True, vp_stage=None)
    out = {"provider": module.__name__, "model": type(model).__name__}
    out["trainable"] = sum(1 for p in model.parameters() if p.requires_grad)
    load_hf_checkpoint(model, build["checkpoint"])
    kimi, spec = model.kimi_config, lora_of(model).spec
    experts = [m for n, m in model.named_modules() if n.endswith(".mlp.experts")]
    out["expert_modes"] = sorted({getattr(e, "mode", "?") for e in experts})
    out["experts_packed_uint8"] = all(e.gate_packed.dtype == torch.uint8 for e in experts)
    out["expert_parameters"] = sum(1 for n, _ in model.named_parameters() if ".mlp.experts." in n)
    with tempfile.TemporaryDirectory() as adapter_dir:
        random_adapter(kimi, spec, seed=payload["seed"], layout=spec.expert_layout).save(adapter_dir)
        out["adapter_tensors_loaded"] = module.load_lora_adapter_hf([model], adapter_dir)
        g = torch.Generator().manual_seed(payload["seed"])
        ids = torch.randint(0, kimi.vocab_size, (2, 9), generator=g)
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        logits = model(ids, pos, attention_mask=None)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():
            ref = load_reference_model(build["checkpoint"], dtype=torch.float64)
            ref_logits = ref(ids, adapter=adapter_dir)
            ref_base = ref(ids)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    rms = lambda a, b: float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    out.update(
        loss=float(loss),
        reference_loss=float(ref_loss),
        logits_rel_rms=rms(logits.detach(), ref_logits),
        adapter_moves_logits_rel_rms=rms(ref_logits, ref_base),
        lora_grads=len(grads),
        lora_grads_nonzero=sum(1 for g in grads if g is not None and bool(g.abs().sum() > 0)),
        lora_grads_finite=all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        base_grads=sum(1 for p in model.parameters() if not p.requires_grad and p.grad is not None),
    )
    return out


def _jsonable(v):
    return json.loads(json.dumps(v, default=repr))


CHECKS["train_hooks"] = check_train_hooks


# The keys miles' train step asks get_batch for (``forward_step`` in radixark/miles:miles/backends/megatron_utils/
# model.py at the pinned commit); rollout_topk_* are not among them.
TRAIN_STEP_KEYS = [
    "tokens",
    "multimodal_train_inputs",
    "packed_seq_params",
    "total_lengths",
    "response_lengths",
    "loss_masks",
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_log_probs",
    "max_seq_lens",
    "witness_ids",
    "opd_reverse_kl",
    "rollout_mask_sums",
]
TOPK_KEYS = ["rollout_topk_token_ids", "rollout_topk_log_probs"]


def _score_centering_data(vocab: int, seed: int):
    """Three samples of miles' per-sample rollout lists and the sampler's top-K (float64), seeded."""
    g = torch.Generator().manual_seed(seed)
    prompts, resps, k = [3, 2, 5], [4, 3, 6], 4
    totals = [p + r for p, r in zip(prompts, resps, strict=True)]
    q = [torch.log_softmax(2 * torch.randn(r, vocab, generator=g, dtype=torch.float64), -1) for r in resps]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in totals]
    ids = [torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(r)]) for r in resps]
    ids[0][1, -1] = -1
    head = [torch.where(i >= 0, qq.gather(1, i.clamp(min=0)), -torch.inf) for qq, i in zip(q, ids, strict=True)]
    masks = [torch.ones(r, dtype=torch.int) for r in resps]
    masks[2][2] = 0
    return {
        "tokens": tokens,
        "total_lengths": totals,
        "response_lengths": resps,
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(a)) for r, a in zip(resps, torch.randn(3, generator=g), strict=True)],
        "rollout_log_probs": [qq.gather(1, t[-r:, None])[:, 0] for qq, t, r in zip(q, tokens, resps, strict=True)],
        "rollout_topk_token_ids": ids,
        "rollout_topk_log_probs": head,
    }


def check_loss_dispatch(payload: dict) -> dict:
    """Our ``--custom-loss-function-path`` through miles' ``loss_function`` (``training_utils/loss.py``: its
    dispatch, ``sum_of_sample_mean`` / per-token reducer and Megatron scaling) on a micro-batch miles' own
    ``get_batch`` packs from a ``DataIterator``, 1 rank; against the plain per-sample score-centering loss
    (``score_centering_from_logits``) on the same float64 logits, value and logits gradient."""
    os.environ.update(payload["env"])
    args = payload.get("args") or parse_miles_args(payload["argv"])
    # no GPU here: miles' get_batch puts cu_seqlens on the current CUDA device (our init's CPU shim answers
    # "cpu" where it ran; Tensor.cuda stays the identity for this process)
    from kimi_megatron_plugin import patches

    patches.apply_cpu_shims()
    torch.Tensor.cuda = lambda self, *a, **k: self
    from miles.backends.training_utils.data import DataIterator, get_batch
    from miles.backends.training_utils.loss import loss_function
    from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    one = GroupInfo(rank=0, size=1, group=None)
    set_parallel_state(ParallelState(one, one, one, one, one, one, one, one))
    vocab = payload["vocab"]
    data = _score_centering_data(vocab, payload["seed"])

    def batch_for(keys):
        it = DataIterator(data, micro_batch_size=len(data["tokens"]))
        return get_batch(it, keys, args.data_pad_size_multiplier, args.qkv_format, allgather_cp=args.allgather_cp)

    out = {"calculate_per_token_loss": args.calculate_per_token_loss}
    batch = batch_for(TRAIN_STEP_KEYS)
    n = batch["tokens"].shape[-1]
    g = torch.Generator().manual_seed(payload["seed"] + 1)
    base = 3 * torch.randn(1, n, vocab, generator=g, dtype=torch.float64)
    out.update(packed_positions=n, train_step_keys=_outcome(lambda: float(loss_function(args, batch, 1, base)[0])))

    logits = base.clone().requires_grad_(True)
    loss, normalizer, _log = loss_function(args, batch_for(TRAIN_STEP_KEYS + TOPK_KEYS), 1, logits, True)
    loss.backward()

    ref_logits = base.clone().requires_grad_(True)
    ref = _reference_loss(args, data, ref_logits)
    ref.backward()
    out.update(
        loss=float(loss),
        reference=float(ref),
        normalizer=float(normalizer),
        grad_max_abs_diff=float((logits.grad - ref_logits.grad).abs().max()),
        grad_max_abs=float(ref_logits.grad.abs().max()),
    )
    return out


CHECKS["loss_dispatch"] = check_loss_dispatch


def check_train_side(payload: dict) -> dict:
    """:func:`check_loss_dispatch`, :func:`check_train_hooks` and :func:`check_topk_transport` in one process
    (miles imported and the arguments parsed once)."""
    os.environ.update(payload["env"])
    payload = {**payload, "args": parse_miles_args(payload["argv"])}
    out = {"loss": check_loss_dispatch(payload)}
    if payload.get("cp"):  # forks its ranks: before this process joins a process group
        out["cp"] = _outcome(lambda: check_cp_loss(payload))
    out["hooks"] = check_train_hooks(payload)
    out["transport"] = _outcome(lambda: check_topk_transport(payload))
    return out


CHECKS["train_side"] = check_train_side


def check_topk_transport(payload: dict) -> dict:
    """The top-K fields from miles samples to the loss through miles' own code: our
    ``--custom-convert-samples-to-train-data-path`` (miles' conversion inside), miles' DP split
    (``split_train_data_by_dp_raw``, its ``_package_shards`` wrapped), then the train step's own
    ``get_batch`` name in ``megatron_utils/model.py`` (wrapped by :func:`install_train_side`) with the train
    step's key list, and miles' ``loss_function``; loss against the plain per-sample float64 loss."""
    from miles.backends.training_utils.data import DataIterator
    from miles.backends.training_utils.loss import loss_function
    from miles.ray.rollout import train_data_conversion
    from miles.utils.types import Sample

    from kimi_rl_glue.miles import topk_transport

    args = payload["args"]
    data = _score_centering_data(payload["vocab"], payload["seed"])
    samples = []
    for i, (tok, resp) in enumerate(zip(data["tokens"], data["response_lengths"], strict=True)):
        s = Sample(index=i, group_index=0, tokens=tok.tolist(), response_length=resp, reward=float(i))
        s.loss_mask = data["loss_masks"][i].tolist()
        s.rollout_log_probs = data["rollout_log_probs"][i].tolist()
        s.status = Sample.Status.COMPLETED
        setattr(s, TOPK_KEYS[0], data[TOPK_KEYS[0]][i].tolist())
        setattr(s, TOPK_KEYS[1], data[TOPK_KEYS[1]][i].tolist())
        samples.append(s)
    topk_transport.install_train_side()  # done already where our init ran (its first step); idempotent
    from miles.backends.megatron_utils import model as train_step

    out = {"get_batch_wrapped": bool(getattr(train_step.get_batch, "_kimi_topk_transport", False))}
    train = topk_transport.convert_samples_to_train_data(args, samples)
    (shard,) = train_data_conversion.split_train_data_by_dp_raw(args, train, dp_size=1)
    out["shard_keys"] = sorted(shard)
    # what get_rollout_data does on the train side for the keys miles knows; advantages as its GRPO step leaves them
    shard["tokens"] = [torch.tensor(t, dtype=torch.long) for t in shard["tokens"]]
    shard["loss_masks"] = [torch.tensor(m, dtype=torch.int) for m in shard["loss_masks"]]
    shard["rollout_log_probs"] = [torch.tensor(x, dtype=torch.float64) for x in shard["rollout_log_probs"]]
    shard["advantages"] = data["advantages"]
    batch = train_step.get_batch(
        DataIterator(shard, micro_batch_size=len(samples)),
        TRAIN_STEP_KEYS,
        args.data_pad_size_multiplier,
        args.qkv_format,
        allgather_cp=args.allgather_cp,
    )
    out["batch_has_topk"] = all(batch.get(k) is not None for k in TOPK_KEYS)
    g = torch.Generator().manual_seed(payload["seed"] + 1)
    logits = 3 * torch.randn(1, batch["tokens"].shape[-1], payload["vocab"], generator=g, dtype=torch.float64)
    out["loss"] = float(loss_function(args, batch, 1, logits, True)[0])
    out["reference"] = float(_reference_loss(args, data, logits))
    return out


def _reference_loss(args, data, logits):
    from kimi_rl_glue.losses.score_centering import score_centering_from_logits

    ref, off = 0, 0
    for i, (total, resp) in enumerate(zip(data["total_lengths"], data["response_lengths"], strict=True)):
        rows = logits[0, off + total - resp - 1 : off + total - 1] / float(args.rollout_temperature)
        off += total
        per_token, _, _ = score_centering_from_logits(
            rows,
            data["tokens"][i][-resp:],
            data["rollout_topk_token_ids"][i],
            data["rollout_log_probs"][i].double(),
            data["rollout_topk_log_probs"][i],
            data["advantages"][i].double(),
            importance=getattr(args, "score_centering_is", "none") or "none",
        )
        m = data["loss_masks"][i].double()
        ref = ref + ((per_token * m).sum() if args.calculate_per_token_loss else (per_token * m).sum() / m.sum())
    return ref


def _cp_rank_loss(args, payload: dict, rank: int, cp: int, queue) -> None:
    """One CP rank (forked, gloo world of ``cp``): the per-token fields as miles hands them to the train step
    (``rollout_log_probs`` and the advantages sliced by ``slice_log_prob_with_cp``, as ``get_rollout_data`` and
    its GRPO step leave them; the top-K full, as the conversion carries them), the micro-batch from the train
    step's (wrapped) ``get_batch``, this rank's zigzag rows of the global logits, miles' ``loss_function``."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive the fork
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(payload["cp_port"]))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=cp)
        queue.put((rank, _cp_loss(args, payload, rank, cp, torch.distributed.group.WORLD)))
    except Exception as e:  # the parent reports it
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def _cp_loss(args, payload: dict, rank: int, cp: int, group) -> dict:
    from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp
    from miles.backends.training_utils.data import DataIterator
    from miles.backends.training_utils.loss import loss_function
    from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    from kimi_megatron_plugin import patches
    from kimi_rl_glue.miles import topk_transport

    patches.apply_cpu_shims()  # no GPU: miles' get_batch puts cu_seqlens on the current CUDA device
    torch.Tensor.cuda = lambda self, *a, **k: self
    one = GroupInfo(rank=0, size=1, group=None)
    cpg = GroupInfo(rank=rank, size=cp, group=group) if cp > 1 else one
    set_parallel_state(ParallelState(one, cpg, cpg, one, one, one, one, one))
    topk_transport.install_train_side()
    from miles.backends.megatron_utils import model as train_step

    data = _score_centering_data(payload["vocab"], payload["seed"])
    for key in ("rollout_log_probs", "advantages"):
        data[key] = [
            slice_log_prob_with_cp(v, t, r, args.qkv_format)
            for v, t, r in zip(data[key], data["total_lengths"], data["response_lengths"], strict=True)
        ]
    batch = train_step.get_batch(
        DataIterator(data, micro_batch_size=len(data["tokens"])),
        TRAIN_STEP_KEYS,
        args.data_pad_size_multiplier,
        args.qkv_format,
        allgather_cp=False,
    )
    # the global logits of each sample over its zigzag-padded length 2 cp * chunk (seeded, the same in every rank)
    g = torch.Generator().manual_seed(payload["seed"] + 2)
    glob = []
    for total in data["total_lengths"]:
        chunk = -(-total // (2 * payload["cp"]))
        glob.append(3 * torch.randn(2 * payload["cp"] * chunk, payload["vocab"], generator=g, dtype=torch.float64))
    pieces, where = [], []  # where: (sample, global row) of each local row
    for i, (total, logits) in enumerate(zip(data["total_lengths"], glob, strict=True)):
        if cp == 1:
            pieces.append(logits[:total])
            where += [(i, p) for p in range(total)]
            continue
        chunk = logits.shape[0] // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            pieces.append(logits[c * chunk : (c + 1) * chunk])
            where += [(i, p) for p in range(c * chunk, (c + 1) * chunk)]
    n = batch["tokens"].shape[-1]
    local = torch.cat(pieces)
    local = torch.cat([local, local.new_zeros(n - local.shape[0], local.shape[1])])[None].requires_grad_(True)
    loss, _normalizer, _log = loss_function(args, batch, 1, local, True)
    loss.backward()
    grads = [torch.zeros_like(x) for x in glob]
    for row, (i, p) in enumerate(where):
        grads[i][p] = local.grad[0, row]
    return {
        "loss": float(loss),
        "topk_rows": [int(x.shape[0]) for x in batch["rollout_topk_token_ids"]],
        "rollout_rows": [int(x.shape[0]) for x in batch["rollout_log_probs"]],
        "grads": [x.tolist() for x in grads],
    }


def check_cp_loss(payload: dict) -> dict:
    """Score centering at CP ``payload["cp"]`` (forked ranks, gloo) through miles' slicing, the wrapped
    ``get_batch`` and ``loss_function``, against CP 1 in this process: miles scales the per-token loss by the CP
    size and Megatron averages the gradients over CP, so the mean over ranks of the returned loss and of the
    logits gradient equal CP 1's."""
    import multiprocessing

    args = payload["args"]
    cp = payload["cp"]
    ctx = multiprocessing.get_context("fork")  # miles is imported; no process group exists yet
    queue = ctx.Queue()
    procs = [ctx.Process(target=_cp_rank_loss, args=(args, payload, r, cp, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = {r: v["error"] for r, v in ranks.items() if "error" in v}
    if errors:
        return {"errors": errors}
    one = _cp_loss(args, payload, 0, 1, None)
    mean_grad = [torch.tensor(g) for g in ranks[0]["grads"]]
    for r in range(1, cp):
        mean_grad = [a + torch.tensor(b) for a, b in zip(mean_grad, ranks[r]["grads"], strict=True)]
    mean_grad = [g / cp for g in mean_grad]
    ref_grad = [torch.tensor(g) for g in one["grads"]]
    return {
        "loss_cp": sum(ranks[r]["loss"] for r in range(cp)) / cp,
        "loss_cp1": one["loss"],
        "rank_losses": [ranks[r]["loss"] for r in range(cp)],
        "topk_rows": [ranks[r]["topk_rows"] for r in range(cp)],
        "rollout_rows": [ranks[r]["rollout_rows"] for r in range(cp)],
        "response_lengths": _score_centering_data(payload["vocab"], payload["seed"])["response_lengths"],
        "grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(mean_grad, ref_grad, strict=True)),
        "grad_max_abs": max(float(b.abs().max()) for b in ref_grad),
    }


CHECKS["cp_loss"] = check_cp_loss
