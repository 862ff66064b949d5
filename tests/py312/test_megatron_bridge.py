"""Kimi K2 / K2.5 / K3 / K3.1 through the REAL megatron-bridge 0.6.2 (with megatron-core 0.19.2), on the CPU.

Oracles: Bridge's own architecture lookup (``AutoBridge`` / ``get_model_bridge``), Bridge's loader
filling a model built by Bridge's provider path, kimi_core.reference logits (fp32, rel <= 1e-4), and
our native loader (:func:`kimi_megatron_plugin.checkpoint.load_hf_checkpoint`) for bit-equality.
TransformerEngine is absent: Bridge imports through :mod:`kimi_megatron_plugin.patches.te_stub`.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from py312_lane import require

require("megatron.bridge", "megatron-bridge==0.6.2")
from kimi_megatron_plugin import bridge as kimi_bridge

kimi_bridge.register()
from megatron.bridge import AutoBridge
from megatron.bridge.models.conversion.model_bridge import get_model_bridge
from safetensors import safe_open
from utils import assert_close

from kimi_core import architectures
from kimi_core.checkpoint import CheckpointReader
from kimi_megatron_plugin import checkpoint, mapping
from kimi_megatron_plugin.registration import MODEL_CLASSES

FAMILIES = {
    family: (architectures.FAMILIES[family], layers)
    for family, layers in (("k2", 3), ("k25", 3), ("k3", 4), ("k31", 4))
}
B, T = 2, 13


def _keys(path) -> set[str]:
    r = CheckpointReader(path)
    return set(r.keys())


@pytest.fixture(scope="module")
def bridged(tiny_ckpt, mcore_world):
    """``family -> (checkpoint path, AutoBridge, model built and loaded by Bridge)``, built once per family."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_ckpt(family, layers=FAMILIES[family][1])
            auto = AutoBridge.from_hf_pretrained(path)
            (model,) = auto.to_megatron_model(
                wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
            )
            cache[family] = (path, auto, model)
        return cache[family]

    return get


def test_te_stub_does_not_fake_transformer_engine():
    """Bridge imported without TE: its unguarded lora_layers got the placeholder, but `import transformer_engine`
    still fails elsewhere."""
    lora_layers = importlib.import_module("megatron.bridge.peft.lora_layers")
    assert lora_layers.te.__name__ == "transformer_engine.pytorch" and "transformer_engine" not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine")
    with pytest.raises(RuntimeError, match="TransformerEngine is not installed"):
        lora_layers.te.Linear()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_autobridge_resolves_our_bridge(family, tiny_ckpt):
    """AutoBridge accepts the tiny release and Bridge's own architecture dispatch returns our bridge for it."""
    arch, layers = FAMILIES[family]
    path = tiny_ckpt(family, layers=layers)
    assert AutoBridge.can_handle(path)
    auto = AutoBridge.from_hf_pretrained(path)
    assert type(auto._model_bridge) is kimi_bridge.registered_bridges()[arch]
    module, _, name = MODEL_CLASSES[arch].partition(":")
    assert kimi_bridge.registered_bridges()[arch] is getattr(importlib.import_module(module), name)
    assert arch in AutoBridge.list_supported_models()
    provider = auto.to_megatron_provider(load_weights=False)
    from kimi_megatron_plugin.bridge.provider import KimiBridgeProvider
    from kimi_megatron_plugin.models.provider import KimiModelProvider

    assert isinstance(provider, KimiBridgeProvider) and isinstance(provider, KimiModelProvider)


def test_plain_deepseek_v3_keeps_bridges_own_bridge():
    """Only model_type kimi_k2 is routed to us: a DeepSeek-V3 config still gets megatron-bridge's DeepSeek-V3 bridge."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_hidden_layers=2, architectures=["DeepseekV3ForCausalLM"])
    auto = AutoBridge.from_hf_config(cfg)
    b = get_model_bridge(auto._causal_lm_architecture, hf_config=cfg)
    assert "DeepSeekV3" in type(b).__name__ or "DeepseekV3" in type(b).__name__, type(b).__name__
    assert not isinstance(b, tuple(kimi_bridge.registered_bridges().values()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mapping_covers_checkpoint_and_model(family, bridged):
    """Every megatron weight of the model our provider builds has a Bridge mapping, and their HF names are exactly
    the checkpoint's tensors (INT4 weight_shape metadata aside)."""
    path, auto, model = bridged(family)
    registry = auto._model_bridge.mapping_registry()
    names = [n for n, _ in model.state_dict(keep_vars=True).items() if not mapping.IGNORED.fullmatch(n)]
    hf = set()
    for n in names:
        m = registry.megatron_to_hf_lookup(n)
        assert m is not None, f"no Bridge mapping for megatron {n}"
        hf |= {m.hf_param} if isinstance(m.hf_param, str) else set(m.hf_param.values())
    on_disk = _keys(path)
    shapes = {k for k in on_disk if k.endswith(".weight_shape")}
    assert hf == on_disk - shapes, (sorted(hf - on_disk)[:5], sorted(on_disk - shapes - hf)[:5])
    assert {k[: -len("shape")] + "packed" for k in shapes} <= hf
    assert (len(names), len(hf)) > (0, 0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bridge_loaded_model_matches_reference_and_native_load(family, bridged):
    """The model Bridge builds (our provider) and loads (our name table) gives kimi_core.reference's fp32 logits
    (rel <= 1e-4) and holds exactly the tensors our native loader reads."""
    from kimi_core.reference import load_reference_model
    from kimi_megatron_plugin.models.provider import build_model_from_hf

    path, _, model = bridged(family)
    ids = torch.randint(0, model.kimi_config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)[None].expand(B, -1)
    with torch.no_grad():
        got = model(ids, pos, attention_mask=None)
    assert_close(f"{family} bridge logits vs reference", load_reference_model(path)(ids), got, 1e-4)
    native = build_model_from_hf(path, perform_initialization=False)
    checkpoint.load_hf_checkpoint(native, path)
    ours, theirs = native.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    bad = [k for k in ours if not mapping.IGNORED.fullmatch(k) and not torch.equal(ours[k], theirs[k])]
    assert not bad, f"Bridge-loaded tensors differ from the native loader's: {bad[:5]}"


def test_qat_masters_through_bridge(tiny_ckpt, mcore_world):
    """K2 with fake-INT4 QAT masters: Bridge's load (our dequantizing hook) fills the same masters as our native
    loader."""
    from kimi_megatron_plugin.models.provider import build_model_from_hf

    path = tiny_ckpt("k2", layers=2)
    auto = AutoBridge.from_hf_pretrained(path)
    provider = auto.to_megatron_provider(load_weights=True)
    provider.expert_mode, provider.expert_kwargs = "qat", {"scale_divisor": 7.0, "q_min": -7}
    (model,) = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
    )
    native = build_model_from_hf(path, perform_initialization=False, expert_mode="qat", scale_divisor=7.0, q_min=-7)
    checkpoint.load_hf_checkpoint(native, path)
    a, b = native.state_dict(), model.state_dict()
    masters = [k for k in a if k.endswith(("gate_weight", "up_weight", "down_weight"))]
    assert masters and all(torch.equal(a[k], b[k]) for k in masters)


def test_wrong_packed_dtype_is_named(tiny_ckpt, mcore_world, tmp_path):
    """A checkpoint whose packed experts are not in the declared format fails in Bridge's load with the tensor named."""
    import json
    import shutil

    from safetensors.torch import save_file

    src = tiny_ckpt("k3", layers=2)
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    victim = next(k for k in sorted(idx) if k.endswith("experts.0.w1.weight_packed"))
    shard = dst / idx[victim]
    with safe_open(str(shard), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd[victim] = sd[victim].to(torch.int32)
    save_file(sd, str(shard), metadata={"format": "pt"})
    with pytest.raises(TypeError, match=victim.replace(".", r"\.") + r" is torch.int32, but quantization_config"):
        AutoBridge.from_hf_pretrained(str(dst)).to_megatron_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
        )
