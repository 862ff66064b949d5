"""Adapter export from the Megatron LoRA: checked buckets (every flipped byte detected), expert-row
filtering, and rejection of bad adapters before anything is sent."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def lora_k2(tiny_ckpt, mcore_world):
    from kimi_core.lora import LoraSpec, random_adapter
    from kimi_megatron_plugin import checkpoint
    from kimi_megatron_plugin.lora import apply_lora
    from kimi_megatron_plugin.models import provider

    path = tiny_ckpt("k2", layers=2)
    m = provider.build_model_from_hf(path, perform_initialization=False)
    checkpoint.load_hf_checkpoint(m, path)
    spec = LoraSpec(rank=8, alpha=16, expert_layout="shared_outer")
    lora = apply_lora(m, spec)
    lora.load_adapter(random_adapter(m.kimi_config, spec, seed=2, layout="shared_outer"))
    yield lora
    lora.remove()


@pytest.mark.parametrize("layout", ["per_expert", "per_expert_3d", "shared_outer", "stacked"])
def test_flipped_byte_in_any_bucket_is_detected(lora_k2, layout):
    """Every bucket of every export layout verifies as sent, and a single flipped byte anywhere in
    any bucket (sampled positions, every bucket) raises BucketChecksumError naming the tensor."""
    from kimi_core.sync.buckets import Bucket, BucketChecksumError, assemble
    from kimi_megatron_plugin.lora import iter_export_buckets

    # stacked folds experts into the rank and keeps gate/up A separate: rank 2r (docs/lora.md)
    max_rank = 16 if layout == "stacked" else 8
    buckets = [
        Bucket.from_parts(b.buffer.clone(), b.metadata())
        for b in iter_export_buckets(lora_k2, 64 << 10, layout=layout, max_rank=max_rank)
    ]
    assert len(buckets) > 3
    got = assemble(buckets)
    assert len(got) > 20
    g = torch.Generator().manual_seed(0)
    for b in buckets:
        for pos in torch.randint(0, b.nbytes, (8,), generator=g).tolist() + [0, b.nbytes - 1]:
            bad = b.buffer.clone()
            bad[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
            with pytest.raises(BucketChecksumError, match="corrupt"):
                Bucket.from_parts(bad, b.metadata())


def test_expert_row_filtering_for_a_consumer_rank(lora_k2):
    """``experts=(lo, hi)`` sends only those experts' rows; the shared factors and dense modules
    travel too, and load_adapter reads the result for that range."""
    from kimi_core.lora import load_adapter
    from kimi_core.sync.buckets import assemble
    from kimi_megatron_plugin.lora import iter_export_buckets

    cfg = lora_k2.config
    got = assemble(iter_export_buckets(lora_k2, 1 << 20, layout="shared_outer", experts=(4, 8)))
    name = "base_model.model.model.layers.1.mlp.experts.gate_proj.lora_B.weight"
    assert got[name].shape[0] == 4 and got[name.replace("lora_B", "lora_A")].shape[0] == 1
    full = lora_k2.export("shared_outer")
    assert torch.equal(got[name], full.tensors[name][4:8])
    ra = load_adapter(got, cfg, adapter_config=full.adapter_config, expert_range=(4, 8))
    assert ra.expert("model.layers.1.mlp", 5, "gate_proj") is not None
    assert ra.expert("model.layers.1.mlp", 9, "gate_proj") is None


def _bad(adapter, edit):
    t = dict(adapter.tensors)
    edit(t)
    return type(adapter)(t, adapter.adapter_config)


@pytest.mark.parametrize(
    "case,match", [("rank", "max"), ("unknown", "not a LoRA target|unknown|no module"), ("nan", "NaN|non-finite|Inf")]
)
def test_bad_adapter_rejected_before_any_bucket(lora_k2, case, match):
    """A rank above the engine's max, an unknown module or a NaN raises AdapterError, naming the
    tensor, from the call itself: no bucket is produced."""
    from kimi_core.lora import AdapterError
    from kimi_megatron_plugin.lora import iter_export_buckets

    ad = lora_k2.export("per_expert")
    max_rank = 8
    if case == "rank":
        max_rank = 4
    elif case == "unknown":
        ad = _bad(
            ad,
            lambda t: t.update(
                {
                    "base_model.model.model.layers.1.mlp.not_a_proj.lora_A.weight": torch.zeros(
                        8, 256, dtype=torch.bfloat16
                    ),
                    "base_model.model.model.layers.1.mlp.not_a_proj.lora_B.weight": torch.zeros(
                        256, 8, dtype=torch.bfloat16
                    ),
                }
            ),
        )
    else:
        k = "base_model.model.model.layers.1.mlp.experts.0.down_proj.lora_B.weight"
        ad = _bad(ad, lambda t: t.update({k: torch.full_like(t[k], float("nan"))}))
    with pytest.raises(AdapterError, match=match) as e:
        iter_export_buckets(ad, 1 << 20, config=lora_k2.config, max_rank=max_rank)
    print(f"{case}: {e.value}")
