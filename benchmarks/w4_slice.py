"""Real-width slices with every routed expert 4-bit, written fast: K2.x in INT4 ``pack-quantized``, K3 / K3.1
in MXFP4 ``mxfp4-pack-quantized`` (the release formats).

``kimi_core.checkpoint.tiny.tiny_state_dict`` draws every weight as floats and quantizes it; at
K2 width that is 16.9 B expert parameters per MoE layer (fp32 masters of ~68 GB), at K3 width 29.6 B. Here the
packed bytes are drawn directly, on the GPU when there is one, and only the non-expert tensors
come from ``tiny_state_dict`` (run at ``top_k`` experts, whose expert tensors are dropped and
whose router is redrawn at the full expert count). Same names, dtypes and weight scaling as
``make-tiny`` (projections ~ 1/sqrt(in), ``down_proj`` further / sqrt(2 L)).

INT4: codes uniform in ``[-7, 7]`` with one ``+-7`` in every group of 32, so ``scale`` is exactly
the group's ``amax / 7`` (in exact arithmetic): the Kimi QAT convention of ``kimi_core.quant.int4``.
MXFP4: E2M1 codes uniform over all 16, one E8M0 scale per group of 32: a power of two ``p`` or ``2p`` at
random, ``p`` the power of two nearest ``std / (rms(E2M1 values) * sqrt(2.5))`` (2.5 = mean of 1 and 4), so
the dequantized std is ``std`` within the sqrt(2) of rounding to a power of two.

Used by ``benchmarks/serving.py vllm`` (K2) and ``serving.py sglang`` (K3); on the command line:
``python benchmarks/w4a16.py slice CONFIG_JSON OUT_DIR``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Iterator

import torch

from kimi_core.checkpoint.tiny import tiny_state_dict
from kimi_core.checkpoint.writer import atomic_write_text, write_checkpoint
from kimi_core.config import KimiConfig
from kimi_core.quant import int4, mxfp4

STAMP = "w4_slice.json"
_STAMP_VERSION = 2
# rms of a code uniform in [-7, 7]: sqrt(2 * (1^2 + ... + 7^2) / 15)
_CODE_RMS = math.sqrt(2 * sum(k * k for k in range(1, 8)) / 15)
# rms of an E2M1 value over the 16 codes (the sign does not change the square)
_E2M1_RMS = math.sqrt(sum(v * v for v in mxfp4.E2M1_VALUES) / len(mxfp4.E2M1_VALUES))


def random_int4_experts(
    n: int, out_features: int, in_features: int, std: float, seed: int, device: str = "cpu", chunk: int = 32
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``n`` random INT4 expert linears ``[out, in]`` in on-disk form, one CPU dict per expert:
    ``weight_packed`` int32 ``[out, in/8]``, ``weight_scale`` bf16 ``[out, in/32]``, ``weight_shape`` int64 ``[2]``.

    :param std: target std of the dequantized weights (scales are ``std / rms(code)`` times U(0.75, 1.25)).
    :param device: where codes are drawn and packed (``cuda`` for K2 sizes); results are copied to the CPU.
    :param chunk: experts drawn per step (GPU memory ~ ``chunk * out * in * 17`` bytes while packing).
    """
    g = int4.GROUP
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = torch.tensor([out_features, in_features], dtype=torch.int64)
    for e0 in range(0, n, chunk):
        c = min(chunk, n - e0)
        q = torch.randint(-7, 8, (c, out_features, in_features // g, g), dtype=torch.int8, device=device, generator=gen)
        q[..., 0] = torch.randint(0, 2, q.shape[:-1], dtype=torch.int8, device=device, generator=gen) * 14 - 7
        packed = int4.pack(q.flatten(-2))
        del q
        u = torch.rand(c, out_features, in_features // g, device=device, generator=gen)
        scale = ((0.75 + 0.5 * u) * (std / _CODE_RMS)).to(torch.bfloat16)
        for i in range(c):  # one storage per tensor: safetensors refuses tensors that share one
            yield {
                "weight_packed": packed[i].to("cpu", copy=True),
                "weight_scale": scale[i].to("cpu", copy=True),
                "weight_shape": shape.clone(),
            }
        del packed, scale


def random_mxfp4_experts(
    n: int, out_features: int, in_features: int, std: float, seed: int, device: str = "cpu", chunk: int = 32
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``n`` random MXFP4 expert linears ``[out, in]`` in on-disk form, one CPU dict per expert:
    ``weight_packed`` uint8 ``[out, in/2]`` (two E2M1 codes, even element low), ``weight_scale`` uint8
    E8M0 ``[out, in/32]``.

    :param std: target std of the dequantized weights (see the module docstring).
    :param device: where codes are drawn and packed (``cuda`` for K3 sizes); results are copied to the CPU.
    :param chunk: experts drawn per step.
    """
    g = mxfp4.GROUP
    gen = torch.Generator(device=device).manual_seed(seed)
    base = 127 + round(math.log2(std / (_E2M1_RMS * math.sqrt(2.5))))
    for e0 in range(0, n, chunk):
        c = min(chunk, n - e0)
        codes = torch.randint(0, 16, (c, out_features, in_features), dtype=torch.uint8, device=device, generator=gen)
        packed = mxfp4.pack(codes)
        del codes
        scale = (base + torch.randint(0, 2, (c, out_features, in_features // g), device=device, generator=gen)).to(
            torch.uint8
        )
        for i in range(c):  # one storage per tensor: safetensors refuses tensors that share one
            yield {"weight_packed": packed[i].to("cpu", copy=True), "weight_scale": scale[i].to("cpu", copy=True)}
        del packed, scale


def slice_state_dict(config: dict, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint for the HF ``config`` dict with 4-bit routed experts in the release format
    (K2.x INT4, K3 / K3.1 MXFP4; experts read ``routed_expert_hidden_size`` where the config has it), keyed by
    HF names."""
    cfg = KimiConfig.from_hf(config, where="w4 slice config")
    E, H, inter, L = cfg.n_routed_experts, cfg.expert_in_size, cfg.moe_intermediate_size, cfg.num_hidden_layers
    draw = random_mxfp4_experts if cfg.is_k3_family else random_int4_experts
    small = copy.deepcopy(config)
    small.get("text_config", small)["n_routed_experts"] = cfg.num_experts_per_tok
    out = tiny_state_dict(small, "none", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    resid = 1.0 / math.sqrt(2 * L)
    gate_n, up_n, down_n = cfg.expert_names
    for layer in range(L):
        if not cfg.is_moe_layer(layer):
            continue
        moe = f"{cfg.layer_prefix(layer)}{cfg.moe_prefix}"
        for k in [k for k in out if k.startswith(f"{moe}.experts.")]:
            del out[k]
        hidden = cfg.hidden_size  # the router reads the full hidden state, the experts the latent one
        out[f"{moe}.gate.weight"] = (torch.randn(E, hidden, generator=gen) / math.sqrt(hidden)).to(torch.bfloat16)
        out[f"{moe}.gate.e_score_correction_bias"] = torch.randn(E, generator=gen) * 0.05
        for j, (name, (o, i, std)) in enumerate(
            ((gate_n, (inter, H, H**-0.5)), (up_n, (inter, H, H**-0.5)), (down_n, (H, inter, inter**-0.5 * resid)))
        ):
            experts = draw(E, o, i, std, seed=seed * 1000 + layer * 3 + j, device=device)
            for e, tensors in enumerate(experts):
                out.update({f"{moe}.experts.{e}.{name}.{k}": v for k, v in tensors.items()})
    return out


def ensure_slice(
    out_dir: str, config: dict, seed: int = 0, device: str = "cpu", max_shard_bytes: int = 4 << 30
) -> dict:
    """Write the slice of :func:`slice_state_dict` to ``out_dir`` unless it is already there with the
    same config and seed (a stamp file says so). Written to ``<out_dir>.partial``, then renamed.

    :returns: ``{"path", "written": bool, "seconds", "bytes"}``.
    """
    stamp = {"version": _STAMP_VERSION, "seed": seed, "config": config}
    stamp_path = os.path.join(out_dir, STAMP)
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == json.loads(json.dumps(stamp)):
                return {"path": out_dir, "written": False, "seconds": 0.0, "bytes": _dir_bytes(out_dir)}
    t = time.perf_counter()
    tmp = f"{out_dir}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = slice_state_dict(config, seed, device)
    write_checkpoint(tmp, tensors, config, max_shard_bytes=max_shard_bytes)
    del tensors
    atomic_write_text(os.path.join(tmp, STAMP), json.dumps(stamp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return {"path": out_dir, "written": True, "seconds": time.perf_counter() - t, "bytes": _dir_bytes(out_dir)}


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
