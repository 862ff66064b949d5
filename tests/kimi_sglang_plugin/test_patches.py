"""The patch ledger is complete for both releases; every row of the running release applies and its target
still is what the recorded facts say; each patch behaves on CPU."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from utils import assert_close

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry
from kimi_sglang_plugin.host_support import FACTS, SUPPORTED_SGLANG, sglang_version
from kimi_sglang_plugin.patches import HOST, LEDGER, covered_releases, patches_for
from kimi_sglang_plugin.patches.hook_patch import release_tag

LIVE = patches_for(sglang_version())


def test_ledger_covers_every_release():
    """Each row is a complete kimi_core PatchEntry for SGLang whose releases hold a supported one; every fix has
    exactly one variant per release, or says why it does not apply there; every target has a facts row for each
    of its releases."""
    from sglang.srt.plugins.hook_registry import HookType

    keys = [s.key for s in LEDGER]
    assert len(keys) == len(set(keys)), keys
    for s in LEDGER:
        assert isinstance(s, PatchEntry) and s.host == HOST, s.key
        assert s.why and s.how and s.upstream and s.remove_when and s.fn, f"{s.key}: incomplete ledger entry"
        assert s.hook_type() in HookType, s.key
        assert covered_releases(s), f"{s.name}: releases {s.versions} hold no supported SGLang release"
        for release in covered_releases(s):
            assert release in FACTS.get(s.target, {}), f"{s.key}: no facts row for {s.target} in {release}"
    for patch in {s.patch for s in LEDGER}:
        variants = [s for s in LEDGER if s.patch == patch]
        covered = [r for s in variants for r in covered_releases(s)]
        assert len(covered) == len(set(covered)), f"{patch}: two variants for one release"
        missing = set(SUPPORTED_SGLANG) - set(covered)
        assert not missing or all(s.absent_in for s in variants), f"{patch}: nothing for {sorted(missing)}"
        if len(variants) > 1:
            for s in variants:
                (release,) = covered_releases(s)
                assert s.name == f"{patch}-{release_tag(release)}", f"{s.name}: a variant is named <patch>-<release>"
        else:
            assert variants[0].name == patch, f"{variants[0].name}: a release suffix without another variant"


def test_every_row_lives_in_the_file_it_is_named_after():
    """Every module of kimi_sglang_plugin/patches/ (but the row type and the shared helper) is a patch file whose
    rows, ENTRY or ENTRIES, are in LEDGER; each row is named ``<file>[.<part>][-<release>]`` after the file that
    holds it and hooks a function of that file (upstream PR numbers stay in ``upstream``)."""
    import importlib
    import pkgutil

    import kimi_sglang_plugin.patches as patches
    from kimi_sglang_plugin.patches import rows_of

    files = sorted(m.name for m in pkgutil.iter_modules(patches.__path__))
    assert files == sorted({row.file for row in LEDGER} | {"config_alias", "hook_patch"}), files
    names = [s.name for s in LEDGER]
    assert len(names) == len(set(names)), names
    for file in {row.file for row in LEDGER}:
        module = importlib.import_module(f"kimi_sglang_plugin.patches.{file}")
        assert hasattr(module, "ENTRY") != hasattr(module, "ENTRIES"), file
        assert hasattr(module, "ENTRY") or len(module.ENTRIES) > 1, f"{file}: one row is ENTRY"
        rows = rows_of(module)
        assert all(any(row is e for e in LEDGER) for row in rows), file
        assert [row.name for row in rows] == [e.name for e in LEDGER if e.file == file], file
        for row in rows:
            assert row.file == file and row.name.startswith(file), (file, row.name)
            assert row.fn.partition(":")[0] == module.__name__, (row.name, row.fn)
            assert not any(pr in row.name for pr in re.findall(r"#(\d+)", row.upstream)), row.name


@pytest.mark.parametrize("spec", LIVE, ids=[s.key for s in LIVE])
def test_hook_applied_and_target_exists(plugin, spec):
    """The target resolves, HookRegistry patched it, and the live symbol is our wrapper."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_core.patch_ledger import resolve_target
    from kimi_sglang_plugin.patches import resolve_hook

    assert spec.why and spec.how and spec.upstream and spec.remove_when, f"{spec.name}: incomplete ledger entry"
    assert spec.target in HookRegistry._patched, f"{spec.name}: {spec.target} not patched"
    live = resolve_target(spec.target)
    live = getattr(live, "__func__", live)
    assert getattr(live, "__wrapped__", None) is not None, f"{spec.name}: {spec.target} is not wrapped"
    assert resolve_hook(spec) is not None


def test_missing_target_is_reported(plugin, monkeypatch):
    """A ledger row whose target has no facts, or vanished (as after an SGLang upgrade), is named by
    patch_problems; rows for another release are not checked against this one, and check_hook_patch refuses
    such a row for this release through kimi_core's check_patch."""
    from kimi_sglang_plugin.host_support import fn
    from kimi_sglang_plugin.patches import check_hook_patch, patch_problems

    release = plugin.running_sglang()
    unrecorded = dataclasses.replace(LIVE[0], name="unrecorded", target="sglang.srt.configs.model_config.no_such_gate")
    gone_target = "sglang.srt.configs.model_config.gone_gate"
    monkeypatch.setitem(FACTS, gone_target, {release: fn("srt/configs/model_config.py:1", "config")})
    gone = dataclasses.replace(LIVE[0], name="gone", target=gone_target)
    other = dataclasses.replace(LIVE[0], name="other", versions="==0.5.22")
    problems = patch_problems(release, (LIVE[0], unrecorded, gone, other))
    assert len(problems) == 2, problems
    assert "no_such_gate has no recorded facts" in problems[0]
    assert "gone_gate: missing" in problems[1] and "model_config.py:1" in problems[1]
    assert patch_problems(release) == []
    with pytest.raises(PatchTargetError, match=f"sglang {release} is outside the checked releases ==0.5.22"):
        check_hook_patch(other, release)


#: a base model without its own get_hidden_dim (as K3's), so SGLang's config-driven dims are used
_NO_DIMS = SimpleNamespace()


def test_fix1_num_shared_experts(plugin):
    """K3 configs expose n_shared_experts, so shared-expert LoRA buffers get moe_inter * num_shared."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.lora.utils import get_hidden_dim

    cfg = KimiLinearConfig(
        hidden_size=256,
        num_attention_heads=2,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_shared_experts=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        num_experts=16,
    )
    assert cfg.n_shared_experts == 2
    assert get_hidden_dim("gate_up_proj", cfg, _NO_DIMS, 1) == (256, 2 * 64 * 2)
    assert get_hidden_dim("down_proj", cfg, _NO_DIMS, 1) == (64 * 2, 256)


def test_fix3_latent_expert_width(plugin):
    """Routed-expert LoRA buffers use routed_expert_hidden_size; models without it are unchanged."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.lora.utils import get_hidden_dim

    cfg = KimiLinearConfig(
        hidden_size=256, num_attention_heads=2, moe_intermediate_size=64, routed_expert_hidden_size=128, num_experts=16
    )
    assert get_hidden_dim("gate_up_proj_moe", cfg, _NO_DIMS, 1) == (128, 128)
    assert get_hidden_dim("down_proj_moe", cfg, _NO_DIMS, 1) == (64, 128)
    cfg.routed_expert_hidden_size = None
    assert get_hidden_dim("gate_up_proj_moe", cfg, _NO_DIMS, 1) == (256, 128)


def test_fix2_output_gate_through_lora_wrapper(plugin):
    """With o_proj LoRA-wrapped, the input still gets x * sigmoid(g_proj(h)), once per forward."""
    from kimi_sglang_plugin.patches.lora_output_gate import (
        TRANSFORM_ATTR,
        output_gate_transform,
        row_parallel_lora_forward,
    )

    g = torch.nn.Linear(8, 6, bias=False)

    class Attn:
        _gate_hidden_states = None
        _gate_pending_stream = None

        def _compute_output_gate(self, h):
            return g(h)

    attn, h, x = Attn(), torch.randn(3, 8), torch.randn(3, 6)
    base = torch.nn.Module()
    object.__setattr__(base, TRANSFORM_ATTR, output_gate_transform(attn))
    wrapper = type("W", (), {"base_layer": base})()
    seen = []
    attn._gate_hidden_states = h
    row_parallel_lora_forward(lambda self, inp: seen.append(inp), wrapper, x)
    assert_close("gated o_proj input", x * torch.sigmoid(g(h)), seen[0], 1e-6)
    row_parallel_lora_forward(lambda self, inp: seen.append(inp), wrapper, x)  # stash consumed
    assert torch.equal(seen[1], x)


def test_fix2_precomputed_gate_0517(monkeypatch):
    """The 0.5.17 variant gates with the alt-stream gate when one was issued (joining its stream first),
    else with g_proj(h); the stash and the slot are consumed once."""
    from kimi_sglang_plugin.patches.lora_output_gate import precomputed_output_gate_transform

    g = torch.nn.Linear(8, 6, bias=False)
    joined = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(wait_stream=joined.append))
    attn = SimpleNamespace(_gate_hidden_states=None, _gate_precomputed=None, g_proj=lambda h: (g(h), None))
    t = precomputed_output_gate_transform(attn)
    h, x = torch.randn(3, 8), torch.randn(3, 6)
    attn._gate_hidden_states = h
    assert_close("gate from g_proj", x * torch.sigmoid(g(h)), t(x), 1e-6)
    assert torch.equal(t(x), x) and joined == []  # stash consumed
    pre = torch.randn(3, 6)
    attn._gate_hidden_states, attn._gate_precomputed = h, (pre, "alt")
    assert_close("gate from alt stream", x * torch.sigmoid(pre), t(x), 1e-6)
    assert joined == ["alt"] and attn._gate_precomputed is None


@pytest.mark.skipif(
    "lora_params_dtype" not in {s.name for s in LIVE},
    reason="the bug is absent in this SGLang release (ledger absent_in)",
)
def test_fix4_params_dtype_mirrored(plugin):
    """BaseLayerWithLoRA exposes its base layer's params_dtype."""
    from sglang.srt.lora.layers import BaseLayerWithLoRA

    base = torch.nn.Linear(4, 4, bias=False)
    base.params_dtype = torch.bfloat16
    assert BaseLayerWithLoRA(base, lora_backend=None).params_dtype is torch.bfloat16


@pytest.mark.skipif(
    "kda_f_b_proj_alias" not in {s.name for s in LIVE},
    reason="the bug is absent in this SGLang release (ledger absent_in)",
)
def test_fix5_f_b_proj_keeps_its_name(plugin):
    """After _merge_bfa_weights (run twice, as on an RL reload) f_b_proj.weight is still a named parameter."""
    from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention

    attn = KimiK3DeltaAttention.__new__(KimiK3DeltaAttention)
    torch.nn.Module.__init__(attn)
    attn.use_full_rank_gate, attn._bfa_uses_block_fp8 = True, False
    attn.f_a_proj, attn.b_proj, attn.f_b_proj = (torch.nn.Linear(16, n, bias=False) for n in (8, 4, 32))
    for _ in range(2):
        attn._merge_bfa_weights()
        names = dict(attn.named_parameters())
        assert "f_b_proj.weight" in names and "_bfa_f_b_w" not in names, sorted(names)
        assert attn._bfa_f_b_w is attn.f_b_proj.weight


def test_checksum_mismatch_refused_not_fatal(plugin, monkeypatch):
    """SGLang's own sha256 check in ``BaseTpWorker.load_lora_adapter_from_tensors`` (run here, patched) raises on
    one flipped byte, which kills a GPU engine; through the hook the load fails with a message naming
    the adapter and tensor, and a payload that matches still reaches the model runner."""
    import hashlib

    import sglang.srt.managers.tp_worker as tpw
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

    monkeypatch.setattr(tpw, "get_parallel", lambda: SimpleNamespace(tp_rank=0), raising=False)
    good = {"base_model.model.layers.0.mlp.down_proj.lora_A.weight": torch.arange(64, dtype=torch.bfloat16).view(4, 16)}
    sha = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in good.items()}
    bad = {k: v.clone() for k, v in good.items()}
    bad_name = next(iter(bad))
    bad[bad_name].view(torch.uint8).view(-1)[7] ^= 0x40
    loaded = []
    manager = SimpleNamespace(lora_refs={})
    manager.create_lora_update_result = LoRAManager.create_lora_update_result.__get__(manager)
    runner = SimpleNamespace(
        lora_manager=manager, load_lora_adapter_from_tensors=lambda ref, t, cfg, added: loaded.append(sorted(t)) or "ok"
    )

    def req(name):
        return LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, lora_id=f"id-{name}", config_dict={}, serialized_named_tensors=[b""], expected_checksums=sha
        )

    for name, payload in (("kimi-v2", bad), ("kimi-v1", good)):
        worker = SimpleNamespace(
            model_runner=runner,
            deserialize_own_rank=lambda _s, p=payload: p,
            _deserialize_own_rank=lambda _s, p=payload: p,
        )
        out = tpw.BaseTpWorker.load_lora_adapter_from_tensors(worker, req(name))
        if name == "kimi-v2":
            assert out.success is False and "'kimi-v2' refused" in out.error_message, out
            assert bad_name in out.error_message and "[LORA-CHECK]" in out.error_message
        else:
            assert out == "ok" and loaded == [sorted(good)]


@pytest.mark.parametrize("width", [512, 1536])
def test_attn_residual_any_width(plugin, width):
    """At a hidden size that is not a multiple of 1024 (where SGLang's Triton kernels leave the mixture
    uninitialised on the GPU) the patched ``_mix_fused`` returns the depth-softmax mixture of
    ``kimi_core.reference.attn_res_aggregate`` in float64 (to fp32 rounding), through SGLang's own eager path;
    multiples of 1024 still reach SGLang's kernels."""
    import sglang.srt.layers.attn_residual as ar

    from kimi_core.reference.attn_res import attn_res_aggregate
    from kimi_core.reference.ops import rms_norm

    g = torch.Generator().manual_seed(width)
    T, nvb, eps = 5, 3, 1e-5
    prefix = torch.randn(T, width, generator=g, dtype=torch.float64)
    bank = torch.randn(T, nvb + 1, width, generator=g, dtype=torch.float64)  # one unused row past nvb
    norm_w, proj_w = (
        1 + 0.1 * torch.randn(width, generator=g, dtype=torch.float64),
        torch.randn(1, width, generator=g, dtype=torch.float64),
    )
    norm = type("Norm", (), {"variance_epsilon": eps, "__call__": lambda self, x: rms_norm(x, norm_w, eps)})()
    proj = type("Proj", (), {"__call__": lambda self, x: (x @ proj_w.T, None)})()
    got = ar._mix_fused(prefix, bank, nvb, proj, norm)
    want = attn_res_aggregate(prefix, list(bank[:, :nvb].unbind(1)), norm_w, proj_w, eps)
    assert got.dtype == prefix.dtype
    assert_close(f"mixture at hidden {width}", want, got, 1e-6)  # SGLang's eager path mixes in fp32
    with pytest.raises(Exception):  # 1024 goes to the Triton kernels, which need CUDA tensors
        ar._mix_fused(
            torch.zeros(T, 1024, dtype=torch.float64), torch.zeros(T, 2, 1024, dtype=torch.float64), 1, proj, norm
        )


def _k3_topk_call(kimi_k3_source: str) -> str:
    """The ``TopK(...)`` call of ``KimiK3MoE.__init__`` in a release's ``models/kimi_k3.py`` source."""
    init = kimi_k3_source[kimi_k3_source.index("class KimiK3MoE") :]
    call = init[init.index("self.topk = TopK(") :]
    return call[: call.index("\n        )")]


def test_routed_experts_capture_reads_k3_config(plugin):
    """SGLang's routed-experts capturer reads ``hf_text_config.num_experts_per_tok``: a K3 config answers with
    ``num_experts_per_token`` (0.5.23: its attribute_map; 0.5.17: hook routed_experts_capture.top_k_name)."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    cfg = KimiLinearConfig(hidden_size=256, num_attention_heads=2, num_experts=16, num_experts_per_token=4)
    assert cfg.num_experts_per_tok == 4


def test_k3_topk_gets_its_layer(plugin):
    """The capture writes under ``TopK.layer_id``: the running release passes it to K3's TopK, or the 0.5.17
    hook sets it (a TopK as 0.5.17 builds it, layer_id None; SGLang's own needs a server config)."""
    import inspect

    from sglang.srt.models import kimi_k3

    from kimi_sglang_plugin.patches.routed_experts_capture import topk_layer_id

    if "routed_experts_capture.topk_layer_id" not in {s.name for s in LIVE}:
        assert "layer_id=self.layer_idx" in _k3_topk_call(inspect.getsource(kimi_k3))
    moe = SimpleNamespace(topk=SimpleNamespace(layer_id=None), layer_idx=3)
    topk_layer_id(None, moe)
    assert moe.topk.layer_id == 3


@pytest.mark.skipif(
    not __import__("os").environ.get("KIMI_SGLANG_SRC_0517"),
    reason="set KIMI_SGLANG_SRC_0517 to an unpacked sglang 0.5.17 wheel",
)
def test_0517_k3_topk_has_no_layer_and_config_no_alias():
    """Why the two routed-experts hooks apply to 0.5.17: its K3 TopK has no layer_id and its KimiLinearConfig
    no attribute_map (read from the 0.5.17 wheel)."""
    import os

    src = os.path.join(os.environ["KIMI_SGLANG_SRC_0517"], "sglang", "srt")
    with open(os.path.join(src, "models", "kimi_k3.py")) as f:
        assert "layer_id" not in _k3_topk_call(f.read())
    with open(os.path.join(src, "configs", "kimi_linear.py")) as f:
        assert "attribute_map" not in f.read()


def _k3_moe_front(dtype=torch.bfloat16):
    """The modules ``KimiK3MoE._merge_front_weights`` reads, at toy sizes (hidden 8, shared 2x6, 4 experts,
    latent 4): a stand-in for a constructed layer (SGLang's own merge runs on it)."""
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype)
    shared = SimpleNamespace(gate_up_proj=lin(8, 12), down_proj=lin(6, 8))
    return SimpleNamespace(
        use_latent_moe=True,
        shared_experts=shared,
        gate=lin(8, 4),
        routed_expert_down_proj=lin(8, 4),
        _front_w=None,
        _front_sizes=None,
        _front_is_ep_pair=False,
        layer_idx=1,
    )


@pytest.mark.parametrize("lora", [False, True])
def test_k3_moe_front_stays_unmerged_with_lora(plugin, tiny_ckpt, monkeypatch, lora):
    """SGLang's merged K3 MoE front reads the shared experts' weights from one merged buffer, past their LoRA
    wrappers. With LoRA on (hook lora_unfused_front) the merge leaves ``_front_w`` None and the fused
    path is not eligible, so forwards call the (wrapped) modules; with LoRA off SGLang merges as it does stock
    (the module weight becomes a view of the merged buffer)."""
    from server_context import publish
    from sglang.srt.models import kimi_k3
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(kimi_k3, "get_moe_a2a_backend", lambda: SimpleNamespace(is_none=lambda: True))
    if hasattr(kimi_k3, "get_platform"):  # 0.5.23 merges on CUDA / ROCm only
        monkeypatch.setattr(kimi_k3, "get_platform", lambda: SimpleNamespace(is_cuda=True, is_hip=False))
    publish(
        ServerArgs(
            model_path=tiny_ckpt("k2"),
            device="cpu",
            tp_size=1,
            enable_lora=lora,
            **({"max_lora_rank": 8, "lora_target_modules": ["gate_up_proj"]} if lora else {}),
        )
    )
    try:
        moe = _k3_moe_front()
        kimi_k3.KimiK3MoE._merge_front_weights(moe)
        eligible = kimi_k3.KimiK3MoE._eligible_for_fused_front.func(moe)
    finally:
        reset_context()
    if lora:
        assert moe._front_w is None and not eligible
    else:
        assert eligible and moe._front_w is not None
        w = moe.shared_experts.gate_up_proj.weight
        assert w.untyped_storage().data_ptr() == moe._front_w.untyped_storage().data_ptr()


def test_hybrid_backend_hands_indexer_metadata_to_full_backend(plugin):
    """K3.1's MLA indexer asks the hybrid KDA + MLA backend for its metadata: the full-attention backend's
    for a full-attention layer, none for a KDA layer (0.5.23 does this itself; hook hybrid_indexer_metadata
    on 0.5.17, run here on the base class's method, which is what 0.5.17's hybrid backend inherits)."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    from kimi_sglang_plugin.patches.hybrid_indexer_metadata import indexer_metadata_from_full_backend

    meta = object()
    full = SimpleNamespace(get_indexer_metadata=lambda layer_id, fb: meta)
    hybrid = SimpleNamespace(full_attn_layers=[3, 7], full_attn_backend=full)
    base = AttentionBackend.get_indexer_metadata
    assert indexer_metadata_from_full_backend(base, hybrid, 3, None) is meta
    assert indexer_metadata_from_full_backend(base, hybrid, 2, None) is None
    if "hybrid_indexer_metadata" not in {s.name for s in LIVE}:  # 0.5.23: its own override does the same
        assert HybridLinearAttnBackend.get_indexer_metadata(hybrid, 7, None) is meta


@pytest.mark.skipif(
    not __import__("os").environ.get("KIMI_SGLANG_SRC_0517"),
    reason="set KIMI_SGLANG_SRC_0517 to an unpacked sglang 0.5.17 wheel",
)
def test_0517_hybrid_backend_does_not_override_indexer_metadata():
    """Why hybrid_indexer_metadata applies to 0.5.17: its HybridLinearAttnBackend inherits
    get_indexer_metadata from AttentionBackend, which answers None (read from the 0.5.17 wheel)."""
    import os

    from source_facts import source_fact

    sym = "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.get_indexer_metadata"
    got = source_fact(os.environ["KIMI_SGLANG_SRC_0517"], sym)
    assert got.where.startswith("srt/layers/attention/base_attn_backend.py:"), got
    assert got == FACTS[sym]["0.5.17"]
