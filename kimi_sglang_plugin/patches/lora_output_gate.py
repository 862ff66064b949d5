"""sgl-project/sglang#37704 item 2: K3's MLA output gate reaches ``o_proj`` when ``o_proj`` carries LoRA.

K3's MLA output gate (``x * sigmoid(g)``) is applied by replacing ``o_proj.forward`` on the instance, but
``RowParallelLinearWithLoRA.forward`` calls the base layer's ``quant_method.apply`` directly: with LoRA on
``o_proj`` the gate is silently dropped. Fix: the gate is attached to ``o_proj`` as an input transform
(:data:`TRANSFORM_ATTR`) after ``KimiK3MLAAttention.__init__``, and the row-parallel LoRA forward applies it
first, so the base GEMM and LoRA A both see the gated input, as without LoRA. The gate is computed as each
release computes it: 0.5.23 through ``_compute_output_gate`` (:func:`output_gate_transform`), 0.5.17 from the
alt-stream ``_gate_precomputed`` or ``g_proj`` (:func:`precomputed_output_gate_transform`); one ledger row per
variant (``lora_output_gate.o_proj_gate-0523`` / ``-0517``). Written from the bug description and the 0.5.17 / 0.5.23 sources, not from the PR's code; a no-op
for models without an output gate.
"""

from __future__ import annotations

import torch

from kimi_sglang_plugin.patches.hook_patch import BOTH, HOST, ONLY_0517, ONLY_0523, PR_37704, HookPatch

__all__ = [
    "ENTRIES",
    "TRANSFORM_ATTR",
    "output_gate_transform",
    "precomputed_output_gate_transform",
    "install_o_proj_input_transform",
    "install_o_proj_precomputed_gate",
    "row_parallel_lora_forward",
]

_GATE_WHY = (
    "K3's MLA output gate (x * sigmoid(g_proj(h))) is applied by replacing o_proj.forward on the "
    "instance; RowParallelLinearWithLoRA calls base_layer.quant_method.apply directly, so with LoRA on "
    "o_proj the gate is silently dropped"
)

#: this file's ledger rows, in the order they are registered
ENTRIES: tuple[HookPatch, ...] = (
    HookPatch(
        name="lora_output_gate.o_proj_gate-0523",
        target="sglang.srt.models.kimi_k3.KimiK3MLAAttention.__init__",
        host=HOST,
        hook="after",
        fn=f"{__name__}:install_o_proj_input_transform",
        why=_GATE_WHY,
        how="AFTER: attach the gate as o_proj._kimi_lora_input_transform, computed as 0.5.23 does "
        "(_compute_output_gate, joining _gate_pending_stream when skipped); the row-parallel hook "
        "applies it inside the LoRA wrapper",
        upstream=PR_37704 + " item 2 (lora_input_transform)",
        remove_when="RowParallelLinearWithLoRA honours a base-layer input transform upstream",
        versions=ONLY_0523,
    ),
    HookPatch(
        name="lora_output_gate.o_proj_gate-0517",
        target="sglang.srt.models.kimi_k3.KimiK3MLAAttention.__init__",
        host=HOST,
        hook="after",
        fn=f"{__name__}:install_o_proj_precomputed_gate",
        why=_GATE_WHY + " (0.5.17: same bug; its gate comes from _gate_precomputed or g_proj)",
        how="AFTER: attach the gate as o_proj._kimi_lora_input_transform, computed as 0.5.17 does "
        "(the alt-stream gate in _gate_precomputed, joined first, else g_proj(h))",
        upstream=PR_37704 + " item 2",
        remove_when="as lora_output_gate.o_proj_gate-0523",
        versions=ONLY_0517,
    ),
    HookPatch(
        name="lora_output_gate.row_parallel_forward",
        target="sglang.srt.lora.layers.RowParallelLinearWithLoRA.forward",
        host=HOST,
        hook="around",
        fn=f"{__name__}:row_parallel_lora_forward",
        why="see lora_output_gate.o_proj_gate-0517 / -0523",
        how="AROUND: input_ = base_layer._kimi_lora_input_transform(input_) when present, so base GEMM "
        "and LoRA A both see the gated input (as without LoRA)",
        upstream=PR_37704 + " item 2",
        remove_when="as lora_output_gate.o_proj_gate-0517 / -0523",
        versions=BOTH,
    ),
)

#: the ``o_proj`` attribute holding the gate as an input transform
TRANSFORM_ATTR = "_kimi_lora_input_transform"


def output_gate_transform(attn):
    """SGLang 0.5.23: ``x -> x * sigmoid(g)`` for K3 MLA ``attn``, ``g = attn._compute_output_gate(h)``
    with ``h`` the attention input stashed by ``KimiK3MLAAttention.forward``; the contract of the stock
    instance wrapper of ``o_proj.forward`` (consumes the stash once, joins a pending gate stream when
    skipped).

    ``x``: ``[T, heads_local * v_head_dim]`` bf16; returns the same shape and dtype.
    """

    def transform(x):
        gate_input = attn._gate_hidden_states
        attn._gate_hidden_states = None
        if gate_input is not None and not isinstance(x, tuple):
            gate = attn._compute_output_gate(gate_input)
            return x * torch.sigmoid(gate)
        if getattr(attn, "_gate_pending_stream", None) is not None:
            torch.cuda.current_stream().wait_stream(attn._gate_pending_stream)
            attn._gate_pending_stream = None
        return x

    return transform


def precomputed_output_gate_transform(attn):
    """SGLang 0.5.17: as :func:`output_gate_transform`, but the gate is ``attn._gate_precomputed``
    (``(gate, producer stream)`` issued on the alt stream by ``_precompute_output_gate``; the stream
    is joined first, and the slot consumed, whether or not the gate is used) or else
    ``attn.g_proj(h)[0]``.

    ``x``: ``[T, heads_local * v_head_dim]`` bf16; returns the same shape and dtype.
    """

    def transform(x):
        gate_input = attn._gate_hidden_states
        attn._gate_hidden_states = None
        pre = getattr(attn, "_gate_precomputed", None)
        attn._gate_precomputed = None
        if pre is not None:
            torch.cuda.current_stream().wait_stream(pre[1])
        if gate_input is None or isinstance(x, tuple):
            return x
        gate = pre[0] if pre is not None else attn.g_proj(gate_input)[0]
        return x * torch.sigmoid(gate)

    return transform


def _install(attn, make) -> None:
    if getattr(attn, "use_output_gate", False) and getattr(attn, "o_proj", None) is not None:
        # object.__setattr__: a closure is not a Module, but keep nn.Module bookkeeping out of it
        object.__setattr__(attn.o_proj, TRANSFORM_ATTR, make(attn))


def install_o_proj_input_transform(result, attn, *args, **kwargs):
    """After ``KimiK3MLAAttention.__init__`` (0.5.23): attach the output gate to ``o_proj`` as an input transform."""
    _install(attn, output_gate_transform)
    return None


def install_o_proj_precomputed_gate(result, attn, *args, **kwargs):
    """After ``KimiK3MLAAttention.__init__`` (0.5.17): attach the output gate to ``o_proj`` as an input transform."""
    _install(attn, precomputed_output_gate_transform)
    return None


def row_parallel_lora_forward(original, self, input_, *args, **kwargs):
    """AROUND ``RowParallelLinearWithLoRA.forward``: apply the base layer's input transform first."""
    transform = getattr(self.base_layer, TRANSFORM_ATTR, None)
    if transform is not None:
        input_ = transform(input_)
    return original(self, input_, *args, **kwargs)
