"""Replay an engine's recorded sublayer and linear inputs through the oracle, one piece at a time.

End-to-end logprobs mix every error of a forward pass: a bf16 rounding in layer 1 can flip a tiny
random router's top-k in layer 3, and then a correct engine looks wrong. Feeding each piece the
*engine's own* input and comparing its output isolates what that piece computes:

* :func:`replay_sublayers` runs ``model.attn[i]`` / ``model.mlp[i]`` (with the adapter) on the
  engine's recorded input of that sublayer and compares with the engine's output;
* :func:`replay_linear` recomputes one LoRA-wrapped linear, ``y = x W^T + s (x A^T) B^T`` for each
  HF module it packs (``q_a_proj`` + ``kv_a_proj_with_mqa``, ``gate_proj`` + ``up_proj``), and
  reports the error of the output and of the LoRA delta alone.

Inputs are what an engine probe records (e.g. :mod:`kimi_vllm_plugin.probe`): ``[T, H]`` tensors of
one sequence at positions ``0..T-1``. Errors are relative RMS (:func:`rel_rms_error`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kimi_core.lora.resolve import AdapterLookup
    from kimi_core.reference.weights import Weights

__all__ = ["rel_rms_error", "replay_sublayers", "replay_linear"]


def rel_rms_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """``||got - ref||_2 / ||ref||_2`` in float64 (the absolute RMS when ``ref`` is zero)."""
    ref64, got64 = ref.detach().double(), got.detach().double()
    den = ref64.pow(2).mean().sqrt().item()
    num = (got64 - ref64).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


@torch.no_grad()
def replay_sublayers(
    model, caps: dict[str, torch.Tensor], adapter: AdapterLookup | None = None, keep_outputs: bool = False
) -> list[dict]:
    """Each recorded sublayer of a K2.x-style model against the oracle on the engine's own input.

    :param model: a :class:`~kimi_core.reference.KimiReferenceModel` (its dtype is the replay dtype).
    :param caps: ``attn_in.{i}`` / ``attn_out.{i}`` / ``mlp_in.{i}`` / ``mlp_out.{i}``, each ``[T, H]``;
        optional ``topk.{i}`` ``[T, k]``: the experts the engine's router chose, replayed in MoE layer
        ``i`` (gate weights from the oracle's own router, :func:`kimi_core.reference.moe.replay_route`).
    :param adapter: what the engine served (anything :meth:`resolve_adapter` takes).
    :param keep_outputs: also return the oracle's output ``"ref"`` ``[T, H]`` in each row (to replay a
        second model, e.g. the oracle in bf16, against it: pass them back as the ``*_out`` entries).
    :returns: rows ``{"layer", "part" ("attn"|"mlp"), "rel_err", "max_abs", "worst_token",
        "worst_token_rel", "replayed_routing"}`` in layer order.
    """
    from kimi_core.reference.moe import MoE

    ad = model.resolve_adapter(adapter)
    rows = []
    for i in range(model.config.num_hidden_layers):
        for part, fn in (
            ("attn", lambda x, i=i: model.attn[i](x, {}, ad)),
            ("mlp", lambda x, i=i: model.mlp[i](x, ad)),
        ):
            x, y = caps.get(f"{part}_in.{i}"), caps.get(f"{part}_out.{i}")
            if x is None or y is None:
                continue
            topk = caps.get(f"topk.{i}") if part == "mlp" and isinstance(model.mlp[i], MoE) else None
            if topk is not None:
                model.mlp[i].replay = topk.long()
            try:
                ref = fn(x.to(model.dtype)[None])[0]
            finally:
                if topk is not None:
                    model.mlp[i].replay = None
            per_tok = (y.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1).clamp_min(1e-30)
            rows.append(
                {
                    "layer": i,
                    "part": part,
                    "rel_err": rel_rms_error(ref, y),
                    "max_abs": (y.double() - ref.double()).abs().max().item(),
                    "worst_token": int(per_tok.argmax()),
                    "worst_token_rel": per_tok.max().item(),
                    "replayed_routing": topk is not None,
                    **({"ref": ref} if keep_outputs else {}),
                }
            )
    return rows


@torch.no_grad()
def replay_linear(
    weights: Weights, adapter: AdapterLookup, modules: list[str], x: torch.Tensor, y: torch.Tensor
) -> dict:
    """One (packed) linear of an engine against ``x W^T + LoRA`` of the HF ``modules`` it concatenates.

    :param weights: :class:`~kimi_core.reference.weights.Weights` (dense, unquantized modules).
    :param adapter: a resolved adapter (``.dense(module)``) or ``None``.
    :param x: ``[T, in]`` the engine's input; ``y``: ``[T, out]`` its output (all ``modules`` stacked).
    :returns: ``{"rel_err"}`` of ``y``, ``"dtype_floor"`` (the error of the exact output merely rounded to
        ``y``'s dtype: what a perfect engine of that dtype would show) and, where the adapter targets one of ``modules``,
        ``"lora_rel_err"`` (the engine's ``y - x W^T`` against the reference delta) and
        ``"lora_share"`` (``||delta|| / ||x W^T||``, how much of ``y`` the delta is).
    """
    x64 = x.double()
    base, delta = [], []
    for m in modules:
        base.append(x64 @ weights.weight(m, torch.float64).T)
        f = adapter.dense(m) if adapter is not None else None
        delta.append(f.delta(x64) if f is not None else torch.zeros_like(base[-1]))
    base64, delta64 = torch.cat(base, -1), torch.cat(delta, -1)
    if tuple(y.shape) != tuple(base64.shape):
        raise ValueError(f"replay_linear {modules}: engine output {tuple(y.shape)} != reference {tuple(base64.shape)}")
    exact = base64 + delta64
    out = {"rel_err": rel_rms_error(exact, y), "dtype_floor": rel_rms_error(exact, exact.to(y.dtype))}
    if delta64.abs().max() > 0:
        out["lora_rel_err"] = rel_rms_error(delta64, y.double() - base64)
        out["lora_share"] = delta64.pow(2).mean().sqrt().item() / max(base64.pow(2).mean().sqrt().item(), 1e-30)
    return out
