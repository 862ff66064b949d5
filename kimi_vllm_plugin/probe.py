"""Record what a running vLLM model computes, layer by layer and LoRA module by LoRA module.

Used by ``kimi-rl check-numerics --engines vllm`` (per-layer hidden states, to name the first
diverging layer) and by the GPU tests (each sublayer and each LoRA-wrapped linear replayed against
``kimi_core.reference``, so a wrong kernel is found where it is, whatever routing did upstream).

The functions run **inside vLLM's worker** through ``LLM.apply_model`` (pickled by name, so they live
in this importable module): :func:`arm` registers forward hooks, the caller runs exactly one request
(prompt logprobs, ``max_tokens=1``: one prefill forward over ``T`` tokens, eager mode), then
:func:`collect` removes the hooks and returns CPU copies. Everything is cloned inside the hooks:
vLLM's fused add-RMSNorm updates its inputs in place later in the same forward.

Recorded (``[T, ...]`` tensors in the model dtype, names are vLLM module names)::

    "embed"                    embeddings                         [T, H]
    "layer.{i}"                residual stream after layer i       [T, H]   (hidden + residual)
    "attn_in.{i}" / "attn_out.{i}"   self_attn input (normed) / output   [T, H]
    "mlp_in.{i}" / "mlp_out.{i}"     mlp input (normed) / output         [T, H]
    "lora_in.<name>" / "lora_out.<name>"   each ``*WithLoRA`` linear's x [T, in] / y [T, out]
    "topk.{i}"                 the experts layer i's router chose   [T, k]   (int)

``topk`` comes from the router's public capture hook (``BaseRouter.set_capture_fn``, the one vLLM's
own routed-experts capturer uses; vLLM 0.26+ GPU MoE); a capture function already set is chained
and restored. A replay then uses the engine's routing, so a bf16 near-tie that the engine and the
oracle break differently is not mistaken for a wrong expert computation.
"""

from __future__ import annotations

__all__ = ["arm", "collect", "decoder_layers"]

#: the worker's live hooks and captures (one armed probe per worker process)
_STATE: dict = {"handles": [], "caps": {}, "routers": []}


def decoder_layers(model):
    """``(layers, embed_tokens)`` of a vLLM DeepSeek-V3-style model (K2, or K2.5 under ``language_model``)."""
    lm = getattr(model, "language_model", None)
    inner = (lm if lm is not None else model).model
    return inner.layers, getattr(inner, "embed_tokens", None)


def _first_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _save(key: str, t) -> None:
    if t is not None:
        _STATE["caps"][key] = t.detach().clone().cpu()


def _arg(args, kwargs, pos: int, name: str):
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


def arm(model) -> int:
    """Register the hooks on ``model`` (worker side); returns how many. Re-arming drops old captures."""
    import torch

    collect(model)
    hs = _STATE["handles"]
    layers, embed = decoder_layers(model)
    if embed is not None:
        hs.append(embed.register_forward_hook(lambda m, a, out: _save("embed", _first_tensor(out))))
    for i, layer in enumerate(layers):
        if not hasattr(layer, "self_attn"):  # PPMissingLayer
            continue

        def layer_out(m, a, out, i=i):
            if isinstance(out, tuple) and len(out) == 2 and out[1] is not None:
                _save(f"layer.{i}", out[0].float() + out[1].float())
            else:
                _save(f"layer.{i}", _first_tensor(out))

        hs.append(layer.register_forward_hook(layer_out))
        # self_attn(positions, hidden_states, ...) ; mlp(hidden_states, ...)
        hs.append(
            layer.self_attn.register_forward_pre_hook(
                lambda m, a, kw, i=i: _save(f"attn_in.{i}", _arg(a, kw, 1, "hidden_states")), with_kwargs=True
            )
        )
        hs.append(
            layer.self_attn.register_forward_hook(lambda m, a, out, i=i: _save(f"attn_out.{i}", _first_tensor(out)))
        )
        hs.append(
            layer.mlp.register_forward_pre_hook(
                lambda m, a, kw, i=i: _save(f"mlp_in.{i}", _arg(a, kw, 0, "hidden_states")), with_kwargs=True
            )
        )
        hs.append(layer.mlp.register_forward_hook(lambda m, a, out, i=i: _save(f"mlp_out.{i}", _first_tensor(out))))
        _capture_routing(layer.mlp, i)
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if not cls.endswith("WithLoRA") or "MoE" in cls or not isinstance(mod, torch.nn.Module):
            continue
        hs.append(
            mod.register_forward_pre_hook(
                lambda m, a, kw, n=name: _save(f"lora_in.{n}", _arg(a, kw, 0, "input_")), with_kwargs=True
            )
        )
        hs.append(mod.register_forward_hook(lambda m, a, out, n=name: _save(f"lora_out.{n}", _first_tensor(out))))
    return len(hs)


def _capture_routing(mlp, i: int) -> None:
    """Chain a ``topk.{i}`` recorder into the MoE router of ``mlp`` where it has the capture hook."""
    moe = getattr(mlp, "experts", None)
    moe = getattr(moe, "base_layer", moe)  # FusedMoEWithLoRA wraps the MoE runner
    router = getattr(moe, "router", None)
    if router is None or not hasattr(router, "set_capture_fn"):
        return
    prev = getattr(router, "capture_fn", None)

    def capture(topk_ids, prev=prev, i=i):
        _save(f"topk.{i}", topk_ids)
        if prev is not None:
            prev(topk_ids)

    router.set_capture_fn(capture)
    _STATE["routers"].append((router, prev))


def collect(model) -> dict:
    """Remove the hooks; return ``{key: CPU tensor}`` recorded since :func:`arm` (worker side)."""
    for h in _STATE["handles"]:
        h.remove()
    for router, prev in _STATE["routers"]:
        router.set_capture_fn(prev)
    caps = _STATE["caps"]
    _STATE["handles"], _STATE["caps"], _STATE["routers"] = [], {}, []
    return caps
