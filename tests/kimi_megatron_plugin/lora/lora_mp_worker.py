"""One rank of a LoRA parallel-equivalence run (spawned by ``test_lora_parallel.py``).

Every rank builds the tiny model for its TP/PP/EP coordinates, loads the checkpoint, applies the
same LoRA spec and random adapter, runs forward + backward of a fixed loss, reduces the LoRA
gradients (``KimiLora.finalize_grads``; DP sum under EP) and returns the full LoRA-factor
gradients keyed by HF module (TP pieces and EP experts gathered, PP stages merged), the full
logits (last stage; batch rows gathered under EP) and the loss ``sum(logits * w)``.
"""

from __future__ import annotations

import mp_worker
import torch

SPEC = dict(rank=4, alpha=8, expert_layout="shared_outer", normalize_moe_lora=True)


def one_config(ckpt: str, tp: int, pp: int, ep: int, dtype: torch.dtype = torch.float32) -> dict:
    from megatron.core import parallel_state as ps

    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.lora import apply_lora, lora_decomposed
    from kimi_megatron_plugin.models import provider

    mp_worker.init_parallel(tp, pp, ep)
    model = provider.build_model_from_hf(
        ckpt,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        perform_initialization=False,
        params_dtype=dtype,
    )
    checkpoint.load_hf_checkpoint(model, ckpt)
    spec = LoraSpec(**SPEC)
    lora = apply_lora(model, spec)
    lora.load_adapter(random_adapter(model.kimi_config, spec, seed=11, layout=spec.expert_layout))
    ids, w, dp_group = mp_worker.split_data_parallel(*mp_worker.inputs(model.kimi_config.vocab_size), ep)
    logits = mp_worker.forward_backward(model, ids, w, pp)
    lora.finalize_grads(dp_group=dp_group)
    dec = lora_decomposed(lora, torch.float32, grads=True)
    grads = {**{k: v for k, v in dec.dense.items()}, **{f"{k[0]}.experts.{k[1]}": v for k, v in dec.experts.items()}}
    if logits is not None and ep > 1:
        logits = mp_worker._gather_rows(logits)
    lora.remove()
    ps.destroy_model_parallel()
    out = {"grads": {k: _cpu(v) for k, v in grads.items()}, "logits": None, "loss": None}
    if logits is not None:
        full_w = mp_worker.inputs(model.kimi_config.vocab_size)[1]
        out["logits"] = logits.detach().float().cpu()
        out["loss"] = float((out["logits"].double() * full_w.cpu().double()).sum())
    return out


def _cpu(v):
    """A factor gradient (a tensor, or a tuple/list of them) as fp32 on the CPU."""
    if isinstance(v, torch.Tensor):
        return v.detach().float().cpu()
    return type(v)(_cpu(x) for x in v)


def spawn(
    ckpt: str,
    out_path: str,
    names=tuple(mp_worker.CONFIGS),
    world: int = 2,
    backend: str = "gloo",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The layouts ``names`` through :func:`mp_worker.spawn` with this module's :func:`one_config`."""
    return mp_worker.spawn(
        ckpt, out_path, names, world=world, config_fn=one_config, backend=backend, kwargs={"dtype": dtype}
    )
