"""A tiny K3.1 checkpoint's tensor names map onto the parameters of the constructed SGLang model.

The model is really constructed: ``KimiK31ForConditionalGeneration`` under a CPU/gloo world of 1
(SGLang's ``init_distributed_environment`` + ``initialize_model_parallel``), ServerArgs published,
ModelConfig and class resolved through SGLang's own loader path, parameters on the meta device.
Written for 0.5.23 (the CPU lane); the two spots where 0.5.17's runtime context differs are marked.
Two test-only shims, both for CPU-only facts of stock SGLang, not of the plugin:
``KimiK3LinearModel.__init__`` creates ``torch.cuda.Stream()`` unconditionally (no driver here),
and the CPU rotary factory accepts only ``deepseek_yarn`` scaling (K3 has none; the plugin
replaces the indexer's rotary with ``NoRope`` anyway). Built unquantized (``Mxfp4Config`` needs
SM90+), so MXFP4 ``weight_scale`` parameters exist only on the GPU and are checked there.
"""

from __future__ import annotations

import socket

import pytest
import torch
from server_context import publish

from kimi_core.architectures import K31


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def k31_model(plugin, tiny_ckpt):
    ckpt = tiny_ckpt("k31")
    import sglang.srt.layers.attention.dsa.dsa_indexer as dsa_indexer
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.runtime_context import get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs

    from kimi_sglang_plugin.models.kimi_k31 import NoRope

    mp = pytest.MonkeyPatch()
    for k, v in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        mp.setenv(k, v)
    mp.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    mp.setattr(dsa_indexer, "get_rope_wrapper", lambda *a, **k: NoRope())
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    sa = ServerArgs(model_path=ckpt, device="cpu", tp_size=1, disable_radix_cache=True, attention_backend="dsa")
    publish(sa)
    override = getattr(get_parallel(), "override_permanently", None)  # 0.5.17 reads parallel_state's world group
    if override is not None:
        override(world_group=parallel_state._WORLD)
    if not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(backend="gloo")
    mc = ModelConfig.from_server_args(sa)
    cls, arch = get_model_architecture(mc)
    with torch.device("meta"):
        model = cls(config=mc.hf_config, quant_config=None)
    mp.undo()
    yield mc, cls, arch, model
    reset_context()


def test_k31_resolves_and_constructs(plugin, k31_model):
    """SGLang's loader path picks our class and an MLA + DSA model config for the K3.1 checkpoint."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    from kimi_sglang_plugin.models.kimi_k31 import KimiK31ForConditionalGeneration, NoRope

    mc, cls, arch, model = k31_model
    assert cls is KimiK31ForConditionalGeneration and arch == K31
    assert mc.attention_arch.name == "MLA" and mc.index_head_dim == 32
    mla = model.mla_layers()
    assert [lid for lid, _ in mla] == model._indexed_layers == [3, 4]
    for _, attn in mla:
        assert isinstance(attn.indexer, Indexer) and isinstance(attn.indexer.rotary_emb, NoRope)
        assert attn.next_skip_topk is None and not attn.skip_topk, "K3's decoder takes the attention output alone"


def test_checkpoint_names_map_onto_parameters(plugin, k31_model, tiny_ckpt, k31_config):
    """Every checkpoint tensor maps to a model parameter and every language-model parameter is fed."""
    from kimi_core.checkpoint import CheckpointReader
    from kimi_sglang_plugin.mapping import sglang_param_names

    _, _, _, model = k31_model
    params = {n for n, _ in model.named_parameters()}
    names = [n for n in CheckpointReader(tiny_ckpt("k31")).keys()]
    mapped = sglang_param_names([n for n in names if not n.endswith(".weight_scale")], k31_config)
    unknown = sorted(set(mapped) - params)
    assert not unknown, f"checkpoint tensors with no SGLang parameter: {unknown[:8]}"
    lm = {p for p in params if p.startswith("language_model.")}
    unfed = sorted(lm - set(mapped))
    assert not unfed, f"SGLang parameters no checkpoint tensor loads: {unfed[:8]}"
    indexer = [n for n in names if ".indexer." in n]
    assert len(indexer) == 2 * 5 and all(n in params for n in indexer)


def test_lora_target_modules_are_accepted_flag_values(plugin):
    """Every ``--lora-target-modules`` value we emit is one SGLang's flag accepts, and SGLang normalizes it to
    the LoRA module the HF leaf lives in (experts: gate_up_proj + down_proj, which FusedMoEWithLoRA needs)."""
    from sglang.srt.lora.utils import get_normalized_target_modules
    from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES

    from kimi_sglang_plugin.mapping import LORA_MODULES, lora_target_modules

    for leaf, module in LORA_MODULES.items():
        names = lora_target_modules([leaf])
        assert set(names) <= set(SUPPORTED_LORA_TARGET_MODULES), f"{leaf}: {names} not accepted by the flag"
        normalized = get_normalized_target_modules(names)
        want = {"gate_up_proj", "down_proj"} if module.endswith("_moe") else {module}
        assert normalized == want, f"{leaf}: SGLang normalizes {names} to {normalized}, expected {want}"
    assert lora_target_modules(["q_a_proj", "w2"]) == ["down_proj", "gate_up_proj", "q_a_proj"]
    with pytest.raises(KeyError, match="no SGLang --lora-target-modules name"):
        lora_target_modules(["f_a_proj"])


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_k31_refuses_attention_backends_without_the_dsa_pool(plugin, tiny_ckpt, backend):
    """The K3.1 class refuses, naming the flag and the flags that work, an engine whose attention backend
    cannot read SGLang's DSA KV pool (the value in effect, as SGLang published it)."""
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs

    from kimi_core.errors import PluginError
    from kimi_sglang_plugin.models.kimi_k31 import check_dsa_attention_backend

    sa = ServerArgs(
        model_path=tiny_ckpt("k31"), device="cpu", tp_size=1, disable_radix_cache=True, attention_backend=backend
    )
    publish(sa)
    try:
        with pytest.raises(
            PluginError, match=f"--attention-backend {backend} cannot serve K3.1.*--attention-backend dsa"
        ):
            check_dsa_attention_backend()
    finally:
        reset_context()
