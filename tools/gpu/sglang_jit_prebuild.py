"""Build SGLang 0.5.17's JIT kernels for Hopper (sm_90a) on a CPU host with nvcc 13.0, into a TVM-FFI cache
that the GPU calls unpack (``tools/gpu/session.sh``), so no device time goes to nvcc.

SGLang builds each kernel on its first call (``sglang/kernels/jit/utils/compile.py`` ``load_jit``) into
``$TVM_FFI_CACHE_DIR/<module>__arch_<arch>__tvmffi_<version>/``; the module name holds the template arguments
and a hash of the sources (not of their location), so a module built here from the same wheel, for the same
arch and tvm-ffi version, is the one a Hopper GPU looks up. The arch comes from SGLang's own
``override_jit_cuda_arch(9, 0)`` (-> ``9.0a``, what it detects on an H100 / H200).

:data:`JOBS` is what the tiny K3 / K3.1 / K2 engines of the GPU lane and the real-width slices build, named by
reading the call sites and from what GPU runs still built themselves. A kernel missing here is still built on the
GPU, slower.

    python tools/gpu/sglang_jit_prebuild.py CACHE_DIR      # with SGLang 0.5.17 + apache-tvm-ffi 0.1.11 importable
"""

from __future__ import annotations

import importlib
import sys
import time

B = "torch.bfloat16"
#: (module under sglang.kernels.ops, loader, arguments); ``torch.x`` names a dtype
JOBS: list[tuple[str, str, tuple]] = [
    ("moe.moe_wna16_marlin", "_jit_moe_wna16_marlin_module", (B, False, False)),  # ~4 min on 2 cores
    ("moe.moe_wna16_marlin", "_jit_moe_wna16_marlin_module", (B, False, True)),  # with bias: ~4 min
    ("quantization.gptq_marlin_repack", "_jit_gptq_marlin_repack_module", ()),
    ("quantization.awq_marlin_repack", "_jit_awq_marlin_repack_module", ()),
    ("kimi_k3.activation", "_jit_situ_and_mul_module", (B,)),
    ("kimi_k3.mla_output_gate", "_jit_mla_output_gate_module", ()),
    ("activation.activation", "activation_module", (B,)),
    ("moe.moe_fused_gate", "_jit_moe_fused_gate_module", ()),
    ("moe.trtllm_lora_temp.kimi_k2_moe_fused_gate", "_jit_kimi_k2_moe_fused_gate_module", ()),
    ("moe.moe_topk_sigmoid", "_jit_moe_topk_sigmoid_module", (B,)),
    ("moe.moe_topk_sigmoid", "_jit_moe_topk_sigmoid_module", ("torch.float32",)),
    ("moe.moe_topk_sum", "_jit_topk_sum_module", ()),
    ("moe.moe_align", "_jit_moe_align_module", ("torch.int32",)),
    ("moe.moe_lora_align", "_jit_moe_align_module", ("torch.int32",)),
    ("moe.moe_align_single_token", "_jit_align_single_token_module", ()),
    ("attention.kda_fused_decode", "_jit_kda_fused_decode_module", ()),
    ("attention.kda_packed_decode", "_jit_kda_packed_decode_module", ()),
    ("attention.rope", "_jit_rotary_embedding_module", ()),
    ("attention.rope", "_jit_fused_rope_module", (False, 64, B, B)),
    ("attention.clamp_position", "_jit_clamp_position_module", ("torch.int64",)),
    ("attention.concat_mla", "_jit_concat_mla_k_module", ()),
    ("attention.concat_mla", "_jit_concat_mla_absorb_q_module", ()),
    ("quantization.dsv32.elementwise", "_jit_k_indexer_norm_rope_module", (B,)),
    ("quantization.dsv32.elementwise", "_jit_k_indexer_norm_rope_store_module", (B, 64)),
    ("layernorm.norm", "_jit_qknorm_across_heads_module", (B,)),
    # hidden, q_lora, kv_lora, head dims of the tiny, small and real-width models (K3 latent MoE norm: 3584)
    *[("layernorm.norm", "_jit_rmsnorm_module", (h, B)) for h in (64, 128, 256, 512, 1024, 1536, 2048, 3584, 7168)],
    ("quantization.gptq_marlin", "_jit_gptq_marlin_module", (B,)),  # ~4 min on 2 cores
    # K3's fused MLA A-projection at hidden 1024 / 512 (q_lora + kv_lora + rope = 704) and the real width's 2112,
    # the bf16 3-way add of K3's MoE tail, and K3.1's DSA top-k
    *[
        ("gemm.dsv3_fused_a_gemm", "dsv3_fused_a_gemm_module", (h, o, True))
        for h, o in ((1024, 704), (512, 704), (7168, 2112))
    ],
    ("elementwise.add3", "_jit_add3_module", ()),
    ("attention.dsv4.topk", "_jit_topk_v2_module", ()),
    # K3.1's first prefill: the DSA index-K store at page 64 and the indexer's Hadamard transform
    ("attention.fused_store_index_cache", "_jit_dsa_fused_store_module", (B, "torch.int64", 64)),
    ("quantization.hadamard", "_jit_hadamard_module", (B,)),
    # MLA's TMA KV-cache store, rows of
    # kv_lora 512 + rope 64 in bf16 (every K3 / K3.1 / K2 width), with PDL on SM90
    ("kvcache.set_mla_kv_buffer", "set_mla_kv_buffer_module", (1024, 128, True)),
]


def _arg(a):
    import torch

    return getattr(torch, a[6:]) if isinstance(a, str) and a.startswith("torch.") else a


def main(cache_dir: str) -> int:
    import os

    os.environ["TVM_FFI_CACHE_DIR"] = cache_dir
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    failed = 0
    with override_jit_cuda_arch(9, 0):
        for i, (mod, loader, args) in enumerate(JOBS, 1):
            t = time.perf_counter()
            try:
                getattr(importlib.import_module("sglang.kernels.ops." + mod), loader)(*map(_arg, args))
                print(f"[{i}/{len(JOBS)}] {mod}.{loader}{args}: {time.perf_counter() - t:.0f} s", flush=True)
            except Exception as e:  # one kernel that does not build leaves the others
                failed += 1
                print(f"[{i}/{len(JOBS)}] {mod}.{loader}{args}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
