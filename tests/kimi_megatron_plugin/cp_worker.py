"""One rank of a context- / sequence-parallel equivalence run (spawned by ``models/test_context_parallel.py``).

Every rank builds the tiny model for its (TP, CP, sequence parallel) coordinates, takes its CP shard of a fixed
batch, runs forward and backward of ``sum(logits * w)`` on its tokens, and returns the whole batch's logits (the CP
shards put back at their global positions, vocab gathered over TP) and the full gradients of every parameter and of
the LoRA factors of a random adapter applied on top (summed over CP: megatron's data-parallel x CP gradient
reduction; TP pieces gathered). Each layout runs an unpacked ``[B, S]`` batch with rollout routing replay (R3, a
fixed random expert choice) and a packed THD batch with the router's own choice.

Sequence parallelism: the model input is the same as without it (megatron's embedding scatters the sequence over
TP); after the backward the gradients are reduced as megatron's training step reduces them: megatron-core's own
``_allreduce_non_tensor_model_parallel_grads`` (the TP sum of parameters marked ``sequence_parallel``, and of
``q_layernorm``), and the routed experts' LoRA factors summed over TP as well (their expert-data-parallel group
spans the TP ranks at ``expert_tensor_parallel_size`` 1, and each TP rank routed only its own tokens).

The CP split of the inputs is written here from megatron's and SkyRL's own recipes (``get_batch_on_this_cp_rank``:
view as ``2 * cp`` chunks, keep chunks ``r`` and ``2 * cp - 1 - r``; ``preprocess_packed_seqs``: the same per padded
sequence), independently of the plugin's layout code.
"""

from __future__ import annotations

import os

import torch

B, S = 2, 16
PADDED_LENS = (8, 16, 12)  # packed sequences, each a multiple of 2 * cp for cp <= 2 (SkyRL pads them so)

# name -> (TP, CP, sequence parallel)
LAYOUTS = {
    "cp1": (1, 1, False),
    "cp2": (1, 2, False),
    "tp2cp2": (2, 2, False),
    "tp2sp": (2, 1, True),
    "tp2spcp2": (2, 2, True),
}
LORA = dict(rank=4, alpha=8, expert_layout="shared_outer", normalize_moe_lora=True)


def unpacked_split(n: int, cp: int, r: int) -> torch.Tensor:
    """Global positions of CP rank ``r``'s tokens of an ``n``-token row (megatron's ``get_batch_on_this_cp_rank``)."""
    return torch.arange(n).view(2 * cp, -1).index_select(0, torch.tensor([r, 2 * cp - 1 - r])).reshape(-1)


def packed_split(lens, cp: int, r: int) -> torch.Tensor:
    """Global positions of CP rank ``r``'s tokens of packed sequences (SkyRL's ``preprocess_packed_seqs``)."""
    out, start = [], 0
    for n in lens:
        half = n // cp // 2
        out += list(range(start + half * r, start + half * (r + 1)))
        out += list(range(start + n - half * (r + 1), start + n - half * r))
        start += n
    return torch.tensor(out)


def _packed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(PADDED_LENS).cumsum(0).tolist()], dtype=torch.int32)
    m = max(PADDED_LENS)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=m,
        max_seqlen_kv=m,
    )


def _batch(vocab: int, packed: bool):
    """Global ids ``[b, n]`` and loss weights ``[b, n, vocab]`` (the same on every rank)."""
    g = torch.Generator().manual_seed(99 if packed else 7)
    b, n = (1, sum(PADDED_LENS)) if packed else (B, S)
    return torch.randint(0, vocab, (b, n), generator=g), torch.randn(b, n, vocab, generator=g)


def _routed(kimi, b: int, n: int) -> torch.Tensor:
    """A fixed random replayed expert choice ``[b, n, layers, k]`` (distinct experts per token and layer)."""
    g = torch.Generator().manual_seed(5)
    r = torch.rand(b, n, kimi.num_hidden_layers, kimi.n_routed_experts, generator=g).argsort(-1)
    return r[..., : kimi.num_experts_per_tok]


class _Wrapped:
    """What megatron's gradient finalisation expects of a model chunk: ``ddp_config`` and the model as ``module``."""

    def __init__(self, model):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.ddp_config, self.module = DistributedDataParallelConfig(), model


def _step(model, lora, packed: bool, tp: int, cp: int, sp: bool) -> dict:
    """Forward + backward of one batch on this rank's CP shard; returns the whole logits and the full gradients."""
    import mp_worker
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather_vocab

    from kimi_megatron_plugin.routing_replay import replay_routing

    ids, w = _batch(model.kimi_config.vocab_size, packed)
    r = ps.get_context_parallel_rank()
    split = (lambda rr: packed_split(PADDED_LENS, cp, rr)) if packed else (lambda rr: unpacked_split(S, cp, rr))
    pos = split(r)
    pos_ids = torch.cat([torch.arange(n) for n in PADDED_LENS])[None] if packed else torch.arange(S)[None].expand(B, -1)
    routed = None if packed else _routed(model.kimi_config, *ids.shape)[:, pos]
    model.zero_grad(set_to_none=True)
    lora.zero_grad(set_to_none=True)
    with replay_routing(model, routed):
        logits = gather_vocab(
            model(
                ids[:, pos],
                pos_ids[:, pos],
                attention_mask=None,
                packed_seq_params=_packed_params() if packed else None,
            )
        )  # [b, n / cp, V]
    (logits.float() * w[:, pos]).sum().backward()
    if sp:
        tp_group = ps.get_tensor_model_parallel_group()
        _allreduce_non_tensor_model_parallel_grads([_Wrapped(model)], model.config, tp_group)
        for p in lora.experts.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=tp_group)
    if cp > 1:
        group = ps.get_context_parallel_group()
        for p in [*model.parameters(), *lora.parameters()]:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=group)
        parts = [torch.empty_like(logits) for _ in range(cp)]
        torch.distributed.all_gather(parts, logits.detach().contiguous(), group=group)
        full = torch.empty(logits.shape[0], ids.shape[1], logits.shape[2])
        for rr, part in enumerate(parts):
            full[:, split(rr)] = part
        logits = full
    from kimi_megatron_plugin.lora import lora_decomposed

    grads = mp_worker._full_grads(
        model, ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group(), None
    )
    dec = lora_decomposed(lora, torch.float32, grads=True)
    factors = {**dec.dense, **{f"{k[0]}.experts.{k[1]}": v for k, v in dec.experts.items()}}
    return {
        "logits": logits.detach().float(),
        "grads": {k: v.float() for k, v in grads.items()},
        "lora": {f"{k} {ab}": _flat(v[i]) for k, v in factors.items() for i, ab in enumerate("AB")},
    }


def _flat(v) -> torch.Tensor:
    """A factor gradient (a tensor, or a tuple/list of per-expert ones) as one fp32 tensor."""
    if isinstance(v, torch.Tensor):
        return v.detach().float().reshape(-1)
    return torch.cat([_flat(x) for x in v])


def one_layout(ckpt: str, tp: int, cp: int, sp: bool = False) -> dict:
    """Build and load the model for (TP, CP, sequence parallel); run the unpacked and the packed batch."""
    from megatron.core import parallel_state as ps

    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.lora import apply_lora
    from kimi_megatron_plugin.models import provider

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, expert_tensor_parallel_size=1)
    model = provider.build_model_from_hf(
        ckpt,
        tensor_parallel=tp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        moe_enable_routing_replay=True,
        perform_initialization=False,
    )
    checkpoint.load_hf_checkpoint(model, ckpt)
    spec = LoraSpec(**LORA)
    lora = apply_lora(model, spec, freeze_base=False)  # base weights keep their gradients too
    lora.load_adapter(random_adapter(model.kimi_config, spec, seed=11, layout=spec.expert_layout))
    out = {"unpacked": _step(model, lora, False, tp, cp, sp), "packed": _step(model, lora, True, tp, cp, sp)}
    lora.remove()
    ps.destroy_model_parallel()
    return out


def run(rank: int, world: int, jobs: list[tuple[str, str, str]], port: int, out_path: str) -> None:
    """The ``jobs`` (``(key, ckpt, layout name)``) one after the other in one ``world``-process gloo world; rank 0
    saves rank 0's results as ``{key: {name: ...}}``. Each layout builds its own model-parallel groups and model
    and destroys them after, so a job runs as it would in a world of its own; only the process start, the imports
    and the gloo world are shared."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from kimi_megatron_plugin import cpu_parallel, patches

    patches.apply_cpu_shims()
    cpu_parallel.cpu_rng_tracker()  # megatron's dropout RNG fork under sequence parallelism, without CUDA
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for key, ckpt, name in jobs:
        results.setdefault(key, {})[name] = one_layout(ckpt, *LAYOUTS[name])
    if rank == 0:
        torch.save(results, out_path)
    torch.distributed.destroy_process_group()


def spawn_jobs(jobs: list[tuple[str, str, str]], out_path: str, world: int = 2) -> dict:
    """Run ``jobs`` (``(key, ckpt, layout name)``) in one spawn of ``world`` processes; returns
    ``{key: {name: {"unpacked"|"packed": {"logits", "grads", "lora"}}}}``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, list(jobs), port, out_path), nprocs=world, join=True)
    return torch.load(out_path, weights_only=False)  # written by run() above, never a foreign file


def spawn(ckpt: str, out_path: str, names=("cp1", "cp2"), world: int = 2) -> dict:
    """Run ``names`` on ``ckpt`` in ``world`` spawned processes; returns ``{name: {"unpacked"|"packed": ...}}``."""
    return spawn_jobs([("run", ckpt, n) for n in names], out_path, world)["run"]
