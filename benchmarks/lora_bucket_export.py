"""CPU baseline of adapter bucket export: GB/s of flatten + checksum for a rank-32 K3 layer slice.

The slice is one K3 MoE decoder layer (MLA attention, shared experts, latent projections) with
``--experts`` routed experts (default 112 = one expert-parallel rank of 896 at EP=8), bf16, in the
per-expert and shared-outer layouts. It reports the export throughput with and without checksums,
the checksum's own throughput and share, a plain memory copy and SHA-256 for comparison, and
appends a table to ``benchmarks/RESULTS.md`` (``--no-append`` to skip).

    python benchmarks/lora_bucket_export.py [--experts 112] [--bucket-mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from results import append, best, cpu_section, git_commit  # noqa: E402

from kimi_core.config import KimiConfig  # noqa: E402
from kimi_core.lora import LoraSpec, iter_buckets  # noqa: E402
from kimi_core.lora.buckets import region_sums  # noqa: E402
from kimi_core.lora.naming import iter_target_groups  # noqa: E402

LAYER = 3  # an MLA + MoE layer of K3


def k3_config() -> KimiConfig:
    full = [4 * i for i in range(1, 24)] + [93]
    text = dict(model_type="kimi_linear", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
                hidden_act="situ", intermediate_size=33792, first_k_dense_replace=1, num_experts=896,
                num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
                routed_expert_hidden_size=3584, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
                mla_use_output_gate=True, attn_res_block_size=12,
                linear_attn_config=dict(num_heads=96, head_dim=128, use_full_rank_gate=True, gate_lower_bound=-5.0,
                                        full_attn_layers=full, kda_layers=[i for i in range(1, 94) if i not in full]))
    return KimiConfig.from_hf({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                               "text_config": text})


def layer_slice(config, layout: str, experts: int, rank: int = 32) -> dict[str, torch.Tensor]:
    spec = LoraSpec(rank=rank, expert_layout="shared_outer" if layout == "shared_outer" else "per_expert")
    g, u, d = config.expert_names
    out: dict[str, torch.Tensor] = {}
    for grp in iter_target_groups(config, spec):
        if grp.layer != LAYER:
            continue
        r, fin, fout = grp.rank, grp.in_features, grp.out_features
        if grp.kind != "expert":
            out[f"base_model.model.{grp.module}.lora_A.weight"] = torch.randn(r, fin).bfloat16()
            out[f"base_model.model.{grp.module}.lora_B.weight"] = torch.randn(fout, r).bfloat16()
        elif layout == "per_expert":
            for e in range(experts):
                out[f"base_model.model.{grp.moe}.experts.{e}.{grp.proj}.lora_A.weight"] = torch.randn(r, fin).bfloat16()
                out[f"base_model.model.{grp.moe}.experts.{e}.{grp.proj}.lora_B.weight"] = torch.randn(fout, r).bfloat16()
        else:
            nA = 1 if grp.proj in (g, u) else experts
            nB = 1 if grp.proj == d else experts
            out[f"base_model.model.{grp.moe}.experts.{grp.proj}.lora_A.weight"] = torch.randn(nA, r, fin).bfloat16()
            out[f"base_model.model.{grp.moe}.experts.{grp.proj}.lora_B.weight"] = torch.randn(nB, fout, r).bfloat16()
    return out


def export(tensors, bucket_bytes, checksum, staging=None):
    n = 0
    for b in iter_buckets(tensors, bucket_bytes, checksum=checksum, staging=staging):
        n += b.nbytes
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=112)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = k3_config()
    bucket_bytes = args.bucket_mib << 20
    rows = []
    for layout in ("per_expert", "shared_outer"):
        tensors = layer_slice(config, layout, args.experts)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        staging = torch.zeros(bucket_bytes, dtype=torch.uint8)  # kept across syncs, pages already faulted in
        t_on = best(lambda: export(tensors, bucket_bytes, True, staging), args.repeats)
        t_off = best(lambda: export(tensors, bucket_bytes, False, staging), args.repeats)
        t_fresh = best(lambda: export(tensors, bucket_bytes, True), args.repeats)
        buckets = list(iter_buckets(tensors, bucket_bytes))
        t_sum = best(lambda: [region_sums(b.buffer, [m.offset for m in b.metas]) for b in buckets], args.repeats)
        t_ver = best(lambda: [b.verify() for b in buckets], args.repeats)
        rows.append((layout, len(tensors), nbytes, len(buckets), nbytes / t_on / 1e9, nbytes / t_off / 1e9,
                     nbytes / t_sum / 1e9, 100 * t_sum / t_on, nbytes / t_ver / 1e9, nbytes / t_fresh / 1e9))
        del buckets
    flat = torch.randint(0, 255, (rows[0][2],), dtype=torch.uint8)
    dst = torch.empty_like(flat)
    copy_gbs = flat.numel() / best(lambda: dst.copy_(flat), args.repeats) / 1e9
    sha_gbs = flat.numel() / best(lambda: hashlib.sha256(flat.numpy()).digest(), 1) / 1e9

    head = ("| layout | tensors | MB | buckets | export GB/s (checksum on) | export GB/s (checksum off) "
            "| checksum GB/s | checksum share of export | verify GB/s | export GB/s, fresh buffer per bucket |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2] / 1e6:.0f} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | "
                     f"{r[7]:.0f}% | {r[8]:.2f} | {r[9]:.2f} |")
    lines.append("")
    lines.append(f"Reference on the same machine: torch uint8 copy {copy_gbs:.2f} GB/s, SHA-256 {sha_gbs:.2f} GB/s. "
                 "Export = flatten into a persistent staging buffer (``staging=``) + per-tensor sums + "
                 "metadata BLAKE2b; GB/s counts adapter bytes.")
    table = "\n".join(lines)
    print(table)
    if args.no_append:
        return
    commit = git_commit(default="uncommitted (no HEAD)")
    path = append(cpu_section(f"LoRA adapter bucket export (CPU), rank 32, K3 layer {LAYER} slice with {args.experts} "
                              f"experts, {args.bucket_mib} MiB buckets", commit, "lora_bucket_export.py", table))
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
