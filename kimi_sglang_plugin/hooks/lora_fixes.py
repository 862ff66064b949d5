"""The five K3 LoRA fixes of sgl-project/sglang#37704 as hooks (ledger: :mod:`kimi_sglang_plugin.hooks`).

Written from the bug descriptions and the 0.5.17 / 0.5.23 sources, not from the PR's code. Each
hook is a no-op for models that do not have the K3 trait it fixes, so it is safe on every model.
Item 2 has one variant per release (the output gate is computed differently, see
:func:`output_gate_transform` and :func:`precomputed_output_gate_transform`); items 4 and 5 fix
bugs that 0.5.17 does not have (the ledger's ``absent_in``).
"""

from __future__ import annotations

import torch

from kimi_sglang_plugin.hooks.config_alias import alias_field

__all__ = [
    "alias_num_shared_experts", "install_o_proj_input_transform", "install_o_proj_precomputed_gate",
    "row_parallel_lora_forward", "latent_moe_hidden_dim", "mirror_params_dtype", "merge_bfa_weights_once",
    "output_gate_transform", "precomputed_output_gate_transform",
]

TRANSFORM_ATTR = "_kimi_lora_input_transform"


# ---------------------------------------------------------------------------------- item 1
def alias_num_shared_experts(result, config, *args, **kwargs):
    """After ``KimiLinearConfig.__init__``: ``n_shared_experts = num_shared_experts`` when unset."""
    alias_field(config, "num_shared_experts", "n_shared_experts")
    return None


# ---------------------------------------------------------------------------------- item 2
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


# ---------------------------------------------------------------------------------- item 3
_LATENT_MODULES = ("gate_up_proj_moe", "down_proj_moe")


def latent_moe_hidden_dim(original, module_name, config, *args, **kwargs):
    """AROUND ``lora.utils.get_hidden_dim(module_name, config, base_model, layer_idx, ...)``:
    routed-expert ``(in, out)`` on the latent width of K3.

    ``gate_up_proj_moe``: ``(routed_expert_hidden_size, 2 * moe_intermediate_size)``;
    ``down_proj_moe``: ``(moe_intermediate_size, routed_expert_hidden_size)``.
    """
    din, dout = original(module_name, config, *args, **kwargs)
    latent = getattr(config, "routed_expert_hidden_size", None)
    if module_name in _LATENT_MODULES and latent:
        if module_name == "gate_up_proj_moe" and din == config.hidden_size:
            din = latent
        elif module_name == "down_proj_moe" and dout == config.hidden_size:
            dout = latent
    return din, dout


# ---------------------------------------------------------------------------------- item 4
def mirror_params_dtype(result, wrapper, base_layer, *args, **kwargs):
    """After ``BaseLayerWithLoRA.__init__``: ``wrapper.params_dtype = base_layer.params_dtype``."""
    dt = getattr(base_layer, "params_dtype", None)
    if dt is not None and "params_dtype" not in wrapper.__dict__:
        object.__setattr__(wrapper, "params_dtype", dt)
    return None


# ---------------------------------------------------------------------------------- item 5
_ALIASES = ("_bfa_f_b_w",)


def merge_bfa_weights_once(original, attn, *args, **kwargs):
    """AROUND ``KimiK3DeltaAttention._merge_bfa_weights``: keep ``_bfa_f_b_w`` an unregistered alias."""
    for name in _ALIASES:
        attn.__dict__.pop(name, None)  # a previous run's plain alias blocks register_parameter
        attn._parameters.pop(name, None)
    out = original(attn, *args, **kwargs)
    for name in _ALIASES:
        p = attn._parameters.pop(name, None)
        if p is not None:
            object.__setattr__(attn, name, p)
    return out
