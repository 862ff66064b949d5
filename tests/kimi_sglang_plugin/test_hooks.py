"""Every ledger hook applies and its target still exists; each #37704 fix behaves on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimi_sglang_plugin.hooks import HOOKS

from utils import assert_close


@pytest.mark.parametrize("spec", HOOKS, ids=[s.name for s in HOOKS])
def test_hook_applied_and_target_exists(plugin, spec):
    """The target resolves, HookRegistry patched it, and the live symbol is our wrapper."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kimi_sglang_plugin.hooks import resolve_hook, resolve_target

    assert spec.why and spec.how and spec.upstream and spec.remove_when, f"{spec.name}: incomplete ledger entry"
    assert spec.target in HookRegistry._patched, f"{spec.name}: {spec.target} not patched"
    live = resolve_target(spec.target)
    live = getattr(live, "__func__", live)
    assert getattr(live, "__wrapped__", None) is not None, f"{spec.name}: {spec.target} is not wrapped"
    assert resolve_hook(spec) is not None


def test_missing_target_is_reported(plugin):
    """A ledger entry whose target vanished (as after an SGLang upgrade) is named by check_targets."""
    from kimi_sglang_plugin.hooks import check_targets

    gone = dataclasses.replace(HOOKS[0], name="gone", target="sglang.srt.configs.model_config.no_such_gate")
    old = dataclasses.replace(HOOKS[0], name="old", versions=("0.5.22",))
    problems = check_targets("0.5.23", (HOOKS[0], gone, old))
    assert len(problems) == 2
    assert "no_such_gate" in problems[0] and "0.5.22" in problems[1]
    assert check_targets("0.5.23") == []


def test_fix1_num_shared_experts(plugin):
    """K3 configs expose n_shared_experts, so shared-expert LoRA buffers get moe_inter * num_shared."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.lora.utils import get_default_hidden_dim

    cfg = KimiLinearConfig(hidden_size=256, num_attention_heads=2, intermediate_size=512, moe_intermediate_size=64,
                           num_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1, num_experts=16)
    assert cfg.n_shared_experts == 2
    assert get_default_hidden_dim("gate_up_proj", cfg, 1) == (256, 2 * 64 * 2)
    assert get_default_hidden_dim("down_proj", cfg, 1) == (64 * 2, 256)


def test_fix3_latent_expert_width(plugin):
    """Routed-expert LoRA buffers use routed_expert_hidden_size; models without it are unchanged."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.lora.utils import get_default_hidden_dim

    cfg = KimiLinearConfig(hidden_size=256, num_attention_heads=2, moe_intermediate_size=64,
                           routed_expert_hidden_size=128, num_experts=16)
    assert get_default_hidden_dim("gate_up_proj_moe", cfg, 1) == (128, 128)
    assert get_default_hidden_dim("down_proj_moe", cfg, 1) == (64, 128)
    cfg.routed_expert_hidden_size = None
    assert get_default_hidden_dim("gate_up_proj_moe", cfg, 1) == (256, 128)


def test_fix2_output_gate_through_lora_wrapper(plugin):
    """With o_proj LoRA-wrapped, the input still gets x * sigmoid(g_proj(h)), once per forward."""
    from kimi_sglang_plugin.hooks.lora_fixes import TRANSFORM_ATTR, output_gate_transform, row_parallel_lora_forward

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


def test_fix4_params_dtype_mirrored(plugin):
    """BaseLayerWithLoRA exposes its base layer's params_dtype."""
    from sglang.srt.lora.layers import BaseLayerWithLoRA

    base = torch.nn.Linear(4, 4, bias=False)
    base.params_dtype = torch.bfloat16
    assert BaseLayerWithLoRA(base, lora_backend=None).params_dtype is torch.bfloat16


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
