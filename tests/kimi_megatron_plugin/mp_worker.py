"""One rank of a parallel-equivalence run (spawned by ``test_parallel.py``; importable by name).

Every rank builds the tiny model for its TP/PP/EP coordinates, loads the HF checkpoint (reading
only its shard), runs forward and backward of a fixed loss and writes, from rank 0, the logits,
the full gradients keyed by layout-independent names (``decoder.layers.<global>.<rest>``, TP and
EP pieces gathered, DP replicas summed) and every rank's read log.

Backends: ``gloo`` (CPU, with :mod:`kimi_megatron_plugin.patches`; the tests) and ``nccl``
(rank ``r`` on ``cuda:r``; ``benchmarks/megatron_trainer.py multi``). Payloads always come back on the CPU.
"""

from __future__ import annotations

import os

import torch

B, T = 2, 13


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def inputs(vocab: int):
    """Token ids ``[B, T]`` and loss weights ``[B, T, vocab]`` (fp32), drawn on the CPU, on this rank's device."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    w = torch.randn(B, T, vocab, generator=g)
    return ids.to(device()), w.to(device())


def _full_grads(model, tp_group, ep_group, dp_sum_group):
    """Layout-independent full gradients of this rank's stage."""
    from kimi_megatron_plugin import mapping
    from kimi_megatron_plugin.checkpoint import all_gather_cat, gather_tp

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        rule, _m, local = mapping.match(name)
        key = (
            name
            if local is None
            else name.replace(
                f"decoder.layers.{local}.", f"decoder.layers.{model.decoder.layers[local].layer_number - 1}.", 1
            )
        )
        g = p.grad.detach().clone()
        if rule.split == "expert":
            g = all_gather_cat(g, 0, ep_group)
        else:
            if dp_sum_group is not None:
                torch.distributed.all_reduce(g, group=dp_sum_group)
            g = torch.cat(gather_tp(g, rule.split, tp_group), dim=0)
        out[key] = g
    return out


CONFIGS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


def split_data_parallel(ids, w, ep: int):
    """Under EP the two ranks are data parallel: rank r takes batch row r; returns (ids, w, dp group or None)."""
    from megatron.core import parallel_state as ps

    if ep == 1:
        return ids, w, None
    r = ps.get_data_parallel_rank()
    return ids[r : r + 1], w[r : r + 1], ps.get_data_parallel_group()


def forward_backward(model, ids, w, pp: int):
    """Forward + backward of ``sum(logits * w)``; with PP=2 the two stages exchange the packed boundary
    tensor and its gradient by send/recv, sized by ``pipeline.bank_tensor_shapes_fn``. Returns the full-vocab
    logits (``None`` on a non-last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather_vocab

    dev = ids.device
    pos = torch.arange(ids.shape[1], device=dev)[None].expand(ids.shape[0], -1)
    if pp == 1:
        logits = gather_vocab(model(ids, pos, attention_mask=None))  # vocab-parallel -> full
        (logits.float() * w).sum().backward()
        return logits
    from kimi_megatron_plugin.models.pipeline import bank_tensor_shapes_fn

    stage = ps.get_pipeline_model_parallel_rank()
    nxt, prv = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
    # the boundary shape megatron's schedule would use, widened for the bank (checked against the tensor)
    shape = (ids.shape[1], ids.shape[0], model.config.hidden_size)
    (recv_shape,), (send_shape,) = bank_tensor_shapes_fn(model)([shape], [shape])
    if stage == 0:
        h = model(ids, pos, attention_mask=None)  # packed [S, B, (N+1)*H]
        if tuple(h.shape) != send_shape:
            raise AssertionError(f"stage 0 output {tuple(h.shape)} != bank_tensor_shapes_fn's send shape {send_shape}")
        torch.distributed.send(h.detach().contiguous(), nxt)
        grad = torch.empty_like(h)
        torch.distributed.recv(grad, nxt)
        h.backward(grad)
        return None
    h = torch.empty(*recv_shape, device=dev, dtype=model.config.pipeline_dtype)
    torch.distributed.recv(h, prv)
    h.requires_grad_(True)
    model.set_input_tensor([h])
    logits = gather_vocab(model(ids, pos, attention_mask=None))
    (logits.float() * w).sum().backward()
    torch.distributed.send(h.grad.contiguous(), prv)
    return logits


# megatron-core's own schedule (GPU: its schedules allocate on "cuda"): how the packed bank crosses stages
SCHEDULES = {
    "varlen": {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"},  # miles' flags
    "adjust": {},  # allgather dispatcher, fixed shapes widened by pipeline.bank_tensor_shapes_fn
}


def schedule_forward_backward(model, ids, w, pp: int, schedule: str):
    """:func:`forward_backward` through ``megatron.core.pipeline_parallel.get_forward_backward_func()``:
    one micro-batch per batch row (1F1B with PP=2), the loss scaled by the micro-batch count so the
    gradients are those of ``sum(logits * w)``. Returns the last stage's full-vocab logits ``[B, S, V]``."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather_vocab

    from kimi_megatron_plugin.models.pipeline import bank_tensor_shapes_fn

    n_mb = ids.shape[0]
    kept = []

    def loss_func(w_row, output):
        logits = gather_vocab(output)
        kept.append(logits.detach())
        return (logits.float() * w_row).sum() * n_mb, {}  # the schedule divides by n_mb

    def step(rows, model):
        r = next(rows)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        return model(ids[r : r + 1], pos, attention_mask=None), partial(loss_func, w[r : r + 1])

    kw = {"adjust_tensor_shapes_fn": bank_tensor_shapes_fn(model)} if pp > 1 and schedule == "adjust" else {}
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(range(n_mb)),
        model=[model],
        num_microbatches=n_mb,
        seq_length=ids.shape[1],
        micro_batch_size=1,
        **kw,
    )
    return torch.cat(kept) if kept else None


def init_parallel(tp: int, pp: int, ep: int) -> None:
    """Megatron's model-parallel groups (ETP 1); on a GPU also its model-parallel CUDA RNG."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def one_config(
    ckpt: str,
    tp: int,
    pp: int,
    ep: int,
    expert_mode: str = "w4a16",
    dtype: torch.dtype = torch.float32,
    schedule: str | None = None,
) -> dict:
    """Build, load, forward and backward for one (TP, PP, EP) layout; returns this rank's payload.

    ``schedule``: ``None`` (explicit send/recv, CPU or GPU) or a :data:`SCHEDULES` key (megatron's
    own schedule, GPU)."""
    from megatron.core import parallel_state as ps

    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.models import provider

    init_parallel(tp, pp, ep)
    model = provider.build_model_from_hf(
        ckpt,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        expert_mode=expert_mode,
        perform_initialization=False,
        params_dtype=dtype,
        **SCHEDULES.get(schedule, {}),
    )
    reader = checkpoint.load_hf_checkpoint(model, ckpt)
    kimi = model.kimi_config
    ids, w, dp_sum_group = split_data_parallel(*inputs(kimi.vocab_size), ep)
    logits = (
        forward_backward(model, ids, w, pp)
        if schedule is None
        else schedule_forward_backward(model, ids, w, pp, schedule)
    )
    grads = _full_grads(model, ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group(), dp_sum_group)
    if ep > 1:
        logits = _gather_rows(logits)
    payload = {
        "logits": logits.detach().float().cpu() if logits is not None else None,
        "grads": {k: v.float().cpu() for k, v in grads.items()},
        "read_log": dict(reader.read_log),
        "bytes_read": reader.bytes_read,
        "full_bytes": {n: _full_bytes(reader, n) for n in reader.read_log},
        "stage_layers": [layer.layer_number - 1 for layer in model.decoder.layers],
    }
    ps.destroy_model_parallel()
    return payload


def run(
    rank: int,
    world: int,
    ckpt: str,
    port: int,
    out_path: str,
    names: list[str],
    config_fn=None,
    kwargs: dict | None = None,
    backend: str = "gloo",
) -> None:
    """All layouts in ``names`` one after the other in the same ``world``-process world.

    ``config_fn(ckpt, tp, pp, ep, **kwargs)`` returns one rank's payload (default: :func:`one_config`).
    ``backend``: ``gloo`` (CPU shims applied) or ``nccl`` (this rank on ``cuda:rank``).
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 runs are compared at 1e-5
        torch.backends.cudnn.allow_tf32 = False
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)
        from kimi_megatron_plugin import patches

        patches.apply_cpu_shims()
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in names:
        payload = (config_fn or one_config)(ckpt, *CONFIGS[name], **(kwargs or {}))
        payload["rank"] = rank
        objs = [None] * world
        torch.distributed.all_gather_object(objs, payload)
        results[name] = objs
    if rank == 0:
        torch.save(results, out_path)
    torch.distributed.destroy_process_group()


def _gather_rows(logits):
    from megatron.core import parallel_state as ps

    from kimi_megatron_plugin.checkpoint import all_gather_cat

    return all_gather_cat(logits.detach(), 0, ps.get_data_parallel_group())


def _full_bytes(reader, name: str) -> int:
    sl = reader._slice(name)
    n = 1
    for s in sl.get_shape():
        n *= s
    return n * {"BF16": 2, "F32": 4, "I32": 4, "U8": 1, "I64": 8, "F16": 2}[sl.get_dtype()]


def spawn(
    ckpt: str,
    out_path: str,
    names=tuple(CONFIGS),
    expert_mode: str = "w4a16",
    world: int = 2,
    config_fn=None,
    backend: str = "gloo",
    kwargs: dict | None = None,
) -> dict:
    """Run the layouts ``names`` in ``world`` spawned processes; returns ``{name: [payload per rank]}``.

    ``config_fn`` (a module-level function, so it pickles) replaces :func:`one_config`; it gets no
    ``expert_mode``. ``kwargs`` go to the config function (e.g. ``dtype``).
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = dict(kwargs or {}, **({} if config_fn is not None else {"expert_mode": expert_mode}))
    mp.spawn(run, args=(world, ckpt, port, out_path, list(names), config_fn, kwargs, backend), nprocs=world, join=True)
    return torch.load(out_path, weights_only=False)  # written by run() above, never a foreign file
