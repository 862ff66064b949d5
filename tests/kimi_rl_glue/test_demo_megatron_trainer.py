"""``kimi_rl_glue.demo.megatron_trainer.MegatronLoraTrainer`` (the demo's ``--trainer megatron``):
reference-equal logits after a step, PEFT export, exact save/resume. Timings belong in
``benchmarks/``, not in a test."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the host of the trainer)")


@pytest.fixture(scope="module")
def k2(tiny_ckpt):
    return tiny_ckpt("k2")


def _spec(path):
    from kimi_core.lora import LoraSpec

    # the demo's spec: all linears but kv_b_proj (absorbed by vLLM's MLA)
    return LoraSpec(rank=8, alpha=16, exclude_modules=("kv_b_proj",), base_model_name_or_path=path)


def _loss(logits, ids):
    return -torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean()


def _ids(vocab, B=32, T=16, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_reference_after_one_step_and_export_format(k2):
    """After one AdamW step the trainer's logits equal kimi_core.reference's with the exported adapter
    (fp32 factors <= 1e-5; the bf16 export the demo ships <= 1e-4); the export is bf16, per-expert
    PEFT names, adapter_config from the spec; torch.distributed is set up and torn down."""
    from kimi_core.reference import load_reference_model
    from kimi_rl_glue.demo.megatron_trainer import MegatronLoraTrainer

    assert not torch.distributed.is_initialized()
    tr = MegatronLoraTrainer(k2, _spec(k2), lr=2e-3, seed=0)
    try:
        assert tr.name == "megatron" and tr.config.family == "k2"
        ids = _ids(tr.config.vocab_size)
        gn = tr.step(_loss(tr.logits(ids), ids))
        assert gn > 0
        ad = tr.export_adapter()
        assert all(t.dtype == torch.bfloat16 for t in ad.tensors.values())
        assert "base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight" in ad.tensors
        assert not any("kv_b_proj" in k for k in ad.tensors)
        cfg = ad.adapter_config
        assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["base_model_name_or_path"] == k2
        ref = load_reference_model(k2)
        x = ids[:4]
        with torch.no_grad():
            got = tr.logits(x)
            assert_close(
                "trainer vs reference (fp32 export)", ref(x, adapter=tr.lora.export(dtype=torch.float32)), got, 1e-5
            )
            assert_close("trainer vs reference (bf16 export)", ref(x, adapter=ad), got, 1e-4)
    finally:
        tr.close()
    assert not torch.distributed.is_initialized()


def test_save_resume_reproduces_next_losses_exactly(k2, tmp_path):
    """Save after two steps; a fresh trainer resumed from it gives bit-equal losses on steps 3 and 4
    (factors and AdamW state restored); the shard directory also holds the HF/PEFT export."""
    from kimi_core.lora import Adapter
    from kimi_rl_glue.demo.megatron_trainer import MegatronLoraTrainer

    batches = [_ids(1024, 8, 12, seed=s) for s in range(4)]
    tr = MegatronLoraTrainer(k2, _spec(k2), lr=5e-3, seed=1)
    try:
        for b in batches[:2]:
            tr.step(_loss(tr.logits(b), b))
        tr.save(str(tmp_path / "ck"))
        want = []
        for b in batches[2:]:
            loss = _loss(tr.logits(b), b)
            want.append(loss.item())
            tr.step(loss)
    finally:
        tr.close()
    tr2 = MegatronLoraTrainer(k2, _spec(k2), lr=5e-3, seed=99)  # other init: everything must come from the shard
    try:
        tr2.load(str(tmp_path / "ck"))
        assert tr2.steps == 2
        got = []
        for b in batches[2:]:
            loss = _loss(tr2.logits(b), b)
            got.append(loss.item())
            tr2.step(loss)
    finally:
        tr2.close()
    assert got == want, f"resumed losses {got} != uninterrupted {want}"
    hf = Adapter.load(str(tmp_path / "ck" / "hf_adapter"))
    assert hf.adapter_config["r"] == 8


def test_resume_rejects_other_spec(k2, tmp_path):
    """Resuming with a different LoraSpec raises, naming the meta file."""
    from kimi_core.lora import LoraSpec
    from kimi_megatron_plugin.lora.checkpoint import LoraCheckpointError
    from kimi_rl_glue.demo.megatron_trainer import MegatronLoraTrainer

    tr = MegatronLoraTrainer(k2, _spec(k2), lr=1e-3)
    try:
        tr.save(str(tmp_path / "ck"))
    finally:
        tr.close()
    tr = MegatronLoraTrainer(k2, LoraSpec(rank=4, alpha=8), lr=1e-3)
    try:
        with pytest.raises(LoraCheckpointError, match="meta_rank0.json"):
            tr.load(str(tmp_path / "ck"))
    finally:
        tr.close()


def test_qat_on_bf16_masters_trains_the_served_grid(k2, tmp_path):
    """The skyrl-k2 recipe's trainer: BF16 masters from ``dequantize_checkpoint`` (verified: they re-quantize to
    the served bytes), experts in fake-INT4 QAT mode on the Kimi grid, capacity-normalised expert LoRA (rank
    16 // top-4 = 4). The fake-quantized expert weights are the masters bit for bit (a fixed point: QAT adds no
    error on top of the grid the engine serves, which dequantizes to the same bf16 values), and after one AdamW
    step the logits equal ``kimi_core.reference`` on the masters with the exported adapter (fp32 factors
    <= 1e-5); the export carries the experts' rank in ``rank_pattern``. (Against the INT4 checkpoint in exact
    fp32 the masters differ by their bf16 rounding of q * scale: 1.2e-3 relative in the logits.)"""
    from kimi_core.checkpoint.dequantize import dequantize_checkpoint
    from kimi_core.config import load_config
    from kimi_core.lora import LoraSpec
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin.models.experts import KimiExperts
    from kimi_rl_glue.demo.megatron_trainer import MegatronLoraTrainer
    from kimi_rl_glue.demo.recipes import KIMI_INT4_GRID

    masters = str(tmp_path / "masters")
    dequantize_checkpoint(k2, masters, *KIMI_INT4_GRID, verify=True, progress=False)
    spec = LoraSpec(
        rank=16, alpha=32, exclude_modules=("kv_b_proj",), normalize_moe_lora=True, base_model_name_or_path=k2
    )
    tr = MegatronLoraTrainer(
        masters,
        spec,
        lr=2e-3,
        seed=0,
        expert_mode="qat",
        grid=KIMI_INT4_GRID,
        quant_format=load_config(k2).quant.format,
    )
    try:
        experts = [m for m in tr.model.modules() if isinstance(m, KimiExperts)]
        assert experts and all(m.mode == "qat" for m in experts)
        for m in experts:
            for p in ("gate", "up", "down"):
                for e in range(m.E):
                    assert torch.equal(m.expert_weight(p, e, torch.float32), getattr(m, f"{p}_weight")[e]), (p, e)
        ids = _ids(tr.config.vocab_size)
        assert tr.step(_loss(tr.logits(ids), ids)) > 0
        ad = tr.lora.export(dtype=torch.float32)
        pattern = ad.adapter_config["rank_pattern"]
        assert pattern and set(pattern.values()) == {4}, pattern
        assert ad.tensors["base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight"].shape[0] == 4
        x = ids[:4]
        with torch.no_grad():
            assert_close(
                "QAT trainer vs reference on the masters",
                load_reference_model(masters)(x, adapter=ad),
                tr.logits(x),
                1e-5,
            )
    finally:
        tr.close()
