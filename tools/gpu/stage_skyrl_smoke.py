"""Smoke check of the SkyRL stack staged by tools/gpu/stage_skyrl.sh, on the GPU machine.

Run after stage_skyrl_unstage.sh, in the project root:
    PYTHONPATH=/tmp/site:$PWD python3 tools/gpu/stage_skyrl_smoke.py
Every check runs even when an earlier one fails; each prints ``ok`` or ``FAIL`` with the exception's last
lines and its wall time, and the script ends with a table and exit status 1 if any check failed.
"""

import importlib
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network

RESULTS: list[tuple[str, str, float]] = []


def check(name):
    """Run the decorated function now and record ``ok`` / ``FAIL`` with its wall time."""

    def run(fn):
        t = time.perf_counter()
        try:
            detail = fn()
            status = "ok"
            print(f"[ok] {name}: {detail if detail is not None else ''}", flush=True)
        except BaseException as e:
            status = "FAIL"
            lines = traceback.format_exception(e)
            print(f"[FAIL] {name}: {type(e).__name__}: {e}", flush=True)
            print("".join(lines[-6:]), flush=True)
        RESULTS.append((name, status, time.perf_counter() - t))
        return fn

    return run


@check("versions")
def _versions():
    from importlib.metadata import version

    import torch

    names = [
        "vllm",
        "ray",
        "transformer-engine",
        "transformer-engine-cu13",
        "transformer-engine-torch",
        "megatron-core",
        "megatron-bridge",
        "transformers",
        "skyrl",
        "skyrl-gym",
        "peft",
        "datasets",
    ]
    found = {}
    for n in names:
        try:
            found[n] = version(n)
        except Exception as e:
            found[n] = f"missing ({type(e).__name__})"
    site = next((p for p in sys.path if os.path.isfile(os.path.join(p, "SKYRL_REF"))), None)
    ref = open(os.path.join(site, "SKYRL_REF")).read().strip() if site else "unknown"
    return (
        f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}; "
        + ", ".join(f"{k} {v}" for k, v in found.items())
        + f"; SkyRL source {ref}"
    )


for _module in [
    "flash_attn.bert_padding",
    "transformer_engine.pytorch",
    "megatron.core",
    "megatron.bridge",
    "vllm",
    "ray",
    "skyrl.train.trainer",
    "skyrl.train.entrypoints.main_base",
    "skyrl.backends.skyrl_train.workers.model_wrapper",
    "skyrl.backends.skyrl_train.workers.megatron.megatron_worker",
    "skyrl.backends.skyrl_train.inference_servers.vllm_server_actor",
    "skyrl.backends.skyrl_train.inference_servers.vllm_router",
]:
    check(f"import {_module}")(lambda m=_module: importlib.import_module(m).__name__)


@check("TE cuDNN fused attention forward (bf16, causal, bshd) vs float32 SDPA")
def _te_attention():
    import torch
    import transformer_engine.pytorch as te

    # only the cuDNN fused backend may run: no FlashAttention 2 is installed, and the unfused one is off
    os.environ["NVTE_FLASH_ATTN"] = "0"
    os.environ["NVTE_FUSED_ATTN"] = "1"
    os.environ["NVTE_UNFUSED_ATTN"] = "0"
    torch.manual_seed(0)
    b, s, h, d = 2, 256, 8, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = te.DotProductAttention(num_attention_heads=h, kv_channels=d, attn_mask_type="causal", qkv_format="bshd")
    out = attn(q, k, v)  # [b, s, h * d]
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True
        )
        .transpose(1, 2)
        .reshape(b, s, h * d)
    )
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    if not rel < 1e-2:
        raise AssertionError(f"relative error {rel:.3e} is over the bf16 bar 1e-2")
    return f"out {tuple(out.shape)} {out.dtype}, relative error {rel:.2e}"


@check("TE Linear forward (bf16) vs float32 matmul")
def _te_linear():
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(1)
    lin = te.Linear(512, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    out = lin(x)
    ref = x.float() @ lin.weight.float().t()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    if not rel < 1e-2:
        raise AssertionError(f"relative error {rel:.3e} is over the bf16 bar 1e-2")
    return f"relative error {rel:.2e}"


@check("flash_attn stand-in on CUDA: unpad_input then pad_input gives back the masked batch")
def _padding():
    import torch
    from flash_attn.bert_padding import pad_input, unpad_input

    x = torch.randn(3, 9, 4, device="cuda")
    mask = (torch.arange(9, device="cuda")[None, :] < torch.tensor([[9], [2], [5]], device="cuda")).int()
    packed, idx, cu, mx, used = unpad_input(x, mask)
    assert cu.tolist() == [0, 9, 11, 16] and mx == 9 and used.tolist() == [9, 2, 5], (cu, mx, used)
    assert torch.equal(pad_input(packed, idx, 3, 9), x * mask[..., None])
    return f"packed {tuple(packed.shape)}"


@check("ray.init() locally and one remote task")
def _ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return f"remote task returned {ray.get(ray.remote(lambda: 6 * 7).remote())}"
    finally:
        ray.shutdown()


@check("SkyRLTrainConfig.from_cli_overrides + validate_cfg (megatron strategy, colocated)")
def _config():
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    # the default logger is wandb, which validate_cfg refuses without WANDB_API_KEY (wandb is not staged)
    cfg = SkyRLTrainConfig.from_cli_overrides(
        [
            "trainer.strategy=megatron",
            "trainer.placement.colocate_all=true",
            "trainer.logger=console",
            "trainer.policy.model.path=Qwen/Qwen2.5-0.5B-Instruct",
        ]
    )
    validate_cfg(cfg)
    return f"strategy {cfg.trainer.strategy}"


print("\n| check | status | seconds |\n| --- | --- | --- |")
for name, status, sec in RESULTS:
    print(f"| {name} | {status} | {sec:.1f} |")
sys.exit(1 if any(s == "FAIL" for _, s, _ in RESULTS) else 0)
