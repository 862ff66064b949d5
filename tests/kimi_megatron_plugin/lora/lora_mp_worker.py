"""One rank of a LoRA parallel-equivalence run (spawned by ``test_lora_parallel.py``).

Every rank builds the tiny model for its TP/PP/EP coordinates, loads the checkpoint, applies the
same LoRA spec and random adapter, runs forward + backward of a fixed loss, reduces the LoRA
gradients (``KimiLora.finalize_grads``; DP sum under EP) and returns the full LoRA-factor
gradients keyed by HF module (TP pieces and EP experts gathered, PP stages merged).
"""

from __future__ import annotations

import os

import torch

import mp_worker

SPEC = dict(rank=4, alpha=8, expert_layout="shared_outer", normalize_moe_lora=True)


def one_config(ckpt: str, tp: int, pp: int, ep: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather_vocab

    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_megatron_plugin import checkpoint, provider
    from kimi_megatron_plugin.lora import apply_lora, lora_decomposed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    model = provider.build_model_from_hf(ckpt, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                         perform_initialization=False)
    checkpoint.load_hf_checkpoint(model, ckpt)
    spec = LoraSpec(**SPEC)
    lora = apply_lora(model, spec)
    lora.load_adapter(random_adapter(model.kimi_config, spec, seed=11, layout=spec.expert_layout))
    ids, w = mp_worker.inputs(model.kimi_config.vocab_size)
    dp_group = None
    if ep > 1:  # data parallel: rank r takes batch row r
        r = ps.get_data_parallel_rank()
        ids, w = ids[r:r + 1], w[r:r + 1]
        dp_group = ps.get_data_parallel_group()
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    if pp == 1:
        (gather_vocab(model(ids, pos, attention_mask=None)) * w).sum().backward()
    else:
        stage = ps.get_pipeline_model_parallel_rank()
        nxt, prv = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
        if stage == 0:
            h = model(ids, pos, attention_mask=None)
            torch.distributed.send(torch.tensor(h.shape), nxt)
            torch.distributed.send(h.detach().contiguous(), nxt)
            grad = torch.empty_like(h)
            torch.distributed.recv(grad, nxt)
            h.backward(grad)
        else:
            shape = torch.empty(3, dtype=torch.long)
            torch.distributed.recv(shape, prv)
            h = torch.empty(*shape.tolist())
            torch.distributed.recv(h, prv)
            h.requires_grad_(True)
            model.set_input_tensor([h])
            (gather_vocab(model(ids, pos, attention_mask=None)) * w).sum().backward()
            torch.distributed.send(h.grad.contiguous(), prv)
    lora.finalize_grads(dp_group=dp_group)
    dec = lora_decomposed(lora, torch.float32, grads=True)
    grads = {**{k: v for k, v in dec.dense.items()}, **{f"{k[0]}.experts.{k[1]}": v for k, v in dec.experts.items()}}
    lora.remove()
    ps.destroy_model_parallel()
    return {"grads": grads}


CONFIGS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


def run(rank: int, world: int, ckpt: str, port: int, out_path: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    from kimi_megatron_plugin import cpu_compat

    cpu_compat.apply_cpu_shims()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in names:
        payload = one_config(ckpt, *CONFIGS[name])
        objs = [None] * world
        torch.distributed.all_gather_object(objs, payload)
        results[name] = objs
    if rank == 0:
        torch.save(results, out_path)
    torch.distributed.destroy_process_group()


def spawn(ckpt: str, out_path: str, names=tuple(CONFIGS), world: int = 2) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, ckpt, port, out_path, list(names)), nprocs=world, join=True)
    return torch.load(out_path, weights_only=False)  # written by run() above, never a foreign file
