"""Builds one Kimi model class of the plugin under a real ``VllmConfig`` on the CPU (no engine) and
loads a checkpoint through the model's ``load_weights``; records what the K3 / K3.1 tests check.

``python build_script.py CKPT OUT_DIR [MAX_MODEL_LEN]`` writes ``OUT_DIR/state.safetensors`` (every
parameter after loading) and ``OUT_DIR/build.json`` (class, loaded names, parameter names, LoRA
members, module names, timings) plus ``OUT_DIR/moe_io.safetensors`` (one MoE block's input and
output) and ``OUT_DIR/indexer_io.safetensors`` (K3.1: one indexer's inputs, scores and keep-mask).
Single process, gloo, the way vLLM's own unit tests build models (a subprocess because vLLM's
distributed and config state are process-global).
"""

import json
import os
import sys
import tempfile
import time


def main(ckpt: str, out_dir: str, max_model_len: int) -> None:
    os.environ.setdefault("VLLM_PLUGINS", "kimi")
    t0 = time.time()
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    # mamba_block_size = max_model_len: the CPU platform turns prefix caching off for MLA models after
    # the hybrid default block size was set, which VllmConfig then rejects
    args = EngineArgs(
        model=ckpt,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        mamba_block_size=max_model_len,
        language_model_only=True,
    )
    cfg = args.create_engine_config()
    res = {"config_s": time.time() - t0}
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{tempfile.mktemp()}"
        )
        initialize_model_parallel(1, 1)
        cls, arch = ModelRegistry.resolve_model_cls(cfg.model_config.architectures, cfg.model_config)
        t1 = time.time()
        torch.set_default_dtype(cfg.model_config.dtype)
        with torch.device("cpu"):
            model = cls(vllm_config=cfg, prefix="")
        torch.set_default_dtype(torch.float32)
        res["build_s"] = time.time() - t1
        tensors = {}
        for f in sorted(os.listdir(ckpt)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(ckpt, f)))
        t2 = time.time()
        loaded = model.load_weights(iter(sorted(tensors.items())))
        res["load_s"] = time.time() - t2
        params = dict(model.named_parameters())
        save_file({n: p.detach().contiguous() for n, p in params.items()}, os.path.join(out_dir, "state.safetensors"))
        res.update(
            model_class=type(model).__name__,
            arch=arch,
            loaded=sorted(loaded),
            params=sorted(params),
            modules=sorted(n for n, _ in model.named_modules()),
            packed_modules_mapping=model.packed_modules_mapping,
            expert_mapping=model.get_expert_mapping(),
            lora={
                m: getattr(model, m)
                for m in (
                    "supports_lora",
                    "is_3d_moe_weight",
                    "is_non_gated_moe",
                    "embedding_modules",
                    "lora_skip_prefixes",
                )
            },
        )
        _moe_io(model, out_dir, res)
        if hasattr(model, "mla_layers"):
            _indexer_io(model, out_dir, res)
    res["total_s"] = time.time() - t0
    with open(os.path.join(out_dir, "build.json"), "w") as f:
        json.dump(res, f)


def _ready(module):
    """fp32 copy-in-place of ``module`` with vLLM's post-load step run on its linears (the CPU GEMM
    dispatch is set there), as the engine's loader does for the whole model."""
    module = module.float()
    for m in module.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(m)
    return module


def _moe_io(model, out_dir, res):
    """Forward the first MoE block (cast to fp32) on fixed random input ``[5, H]``."""
    import torch
    from safetensors.torch import save_file

    from kimi_vllm_plugin.models.cpu_moe import KimiK3CpuMoE

    name, moe = next((n, m) for n, m in model.named_modules() if isinstance(m, KimiK3CpuMoE))
    moe = _ready(moe)
    x = torch.randn(5, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = moe(x)
    save_file({"x": x, "y": y}, os.path.join(out_dir, "moe_io.safetensors"))
    res["moe_block"] = name


def _indexer_io(model, out_dir, res):
    """Run the first MLA layer's indexer (fp32) on fixed random ``x [T, H]``, ``qr [T, q_lora_rank]``,
    T = index_topk + 5, so the later queries see more keys than the top-k keeps."""
    import torch
    from safetensors.torch import save_file

    layer = model.mla_layers()[0]
    idx = _ready(model.language_model.model.layers[layer].self_attn.indexer)
    t = model.config.text_config
    g = torch.Generator().manual_seed(1)
    T = t.index_topk + 5
    x, qr = torch.randn(T, t.hidden_size, generator=g), torch.randn(T, t.q_lora_rank, generator=g)
    scores, keep = idx(x, qr)
    save_file(
        {"x": x, "qr": qr, "scores": scores, "keep": keep.to(torch.uint8)},
        os.path.join(out_dir, "indexer_io.safetensors"),
    )
    res["indexer_layer"], res["mla_layers"] = layer, model.mla_layers()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 128)
