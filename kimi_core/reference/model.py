"""``KimiReferenceModel``: the pure-PyTorch numerical oracle of Kimi K2.x, K3 and K3.1.

One class for every family, driven by :class:`kimi_core.config.KimiConfig`:

* K2 / K2.5 (DeepSeek-V3 architecture): MLA with YaRN RoPE, dense layer 0, ``noaux_tc`` MoE
  with INT4 experts and shared experts, plain residuals.
* K3: KDA layers and NoPE gated MLA layers (``linear_attn_config``), attention-residual bank
  (``attn_res_block_size``), latent MoE with SiTU and MXFP4 experts.
* K3.1: K3 plus the DSA lightning indexer on the MLA layers ([I], see ``indexer.py``).

Weights come from a :class:`~kimi_core.checkpoint.CheckpointReader` (``load_reference_model``) or
an in-memory HF-named dict (:meth:`KimiReferenceModel.from_state_dict`); routed experts stay
packed and are dequantized per layer on the fly. Every linear goes through
:meth:`kimi_core.reference.weights.Weights.linear`, which adds the LoRA delta of ``adapter``.

No padding masks: every row of a batch is a full sequence starting at position 0. That K2.5's
language model sits under ``language_model.`` with K2's names is inferred [I] (kimi_arch.md section 5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kimi_core.config import KimiConfig
from kimi_core.reference.attn_res import ResidualBank
from kimi_core.reference.kda import KDALayer
from kimi_core.reference.mla import MLALayer
from kimi_core.reference.moe import DenseMLP, MoE
from kimi_core.reference.ops import acc_dtype, rms_norm
from kimi_core.reference.weights import StateDictSource, Weights

if TYPE_CHECKING:
    from kimi_core.lora.resolve import AdapterLookup

__all__ = ["DecodeState", "KimiReferenceModel", "load_reference_model"]


@dataclass
class DecodeState:
    """Incremental-decoding state returned by :meth:`KimiReferenceModel.prefill` / ``step``.

    ``caches[i]`` is layer i's dict: MLA ``c``/``k_pe``/``pos`` (+ ``idx_k`` for K3.1), KDA
    ``conv_q/conv_k/conv_v``/``S``. The attention-residual bank is per token, so it is rebuilt for
    each new token and nothing of it is carried; ``bank`` keeps the last token's final bank
    (``ceil(L / block)`` tensors ``[B, T, H]``) for inspection. ``logits`` ``[B, vocab]`` are those
    of the last position processed.
    """

    caches: list[dict]
    pos: int = 0
    logits: torch.Tensor | None = None
    adapter: object = None
    bank: list[torch.Tensor] = field(default_factory=list)


class KimiReferenceModel:
    """The oracle model. Call it like a function: ``model(input_ids) -> logits [B, T, vocab]``.

    :param config: parsed config; ``source``: checkpoint reader or :class:`StateDictSource`.
    :param dtype: compute dtype (fp32 default; fp64 for float64 recomputations).
    :param kda_mode: ``"chunk"`` (chunk-64 form, default for T > 1) or ``"recurrent"``.
    :param mla_latent_eps: override of the MLA latent-norm eps (default: :data:`~kimi_core.reference.mla.MLA_LATENT_NORM_EPS`).
    """

    def __init__(
        self,
        config: KimiConfig,
        source,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kda_mode: str = "chunk",
        mla_latent_eps: float | None = None,
    ):
        if kda_mode not in ("chunk", "recurrent"):
            raise ValueError(f"kda_mode={kda_mode!r}: expected 'chunk' or 'recurrent'")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = Weights(source, dtype, device)
        lm = config.lm_prefix
        self.embed_name = f"{lm}model.embed_tokens"
        self.norm_name = f"{lm}model.norm"
        self.head_name = f"{lm}lm_head"
        self.attn, self.mlp = [], []
        for i in range(config.num_hidden_layers):
            lp = config.layer_prefix(i)
            if config.is_kda_layer(i):
                self.attn.append(KDALayer(config, self.weights, f"{lp}self_attn", kda_mode))
            else:
                self.attn.append(MLALayer(config, self.weights, f"{lp}self_attn", mla_latent_eps))
            if config.is_moe_layer(i):
                self.mlp.append(MoE(config, self.weights, f"{lp}{config.moe_prefix}"))
            else:
                self.mlp.append(DenseMLP(config, self.weights, f"{lp}mlp"))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(cls, config: KimiConfig | dict, tensors: dict[str, torch.Tensor], **kw) -> KimiReferenceModel:
        """Build from an HF config (dict or parsed) and an HF-named tensor dict (tests)."""
        cfg = config if isinstance(config, KimiConfig) else KimiConfig.from_hf(config)
        src = StateDictSource(tensors, cfg.quant.format if cfg.quant else None)
        return cls(cfg, src, **kw)

    def resolve_adapter(self, adapter: AdapterLookup | str | os.PathLike | dict | None) -> AdapterLookup | None:
        """``None``, an object with ``dense``/``expert`` methods, or a PEFT dir / dict for ``kimi_core.lora.load_adapter``."""
        if adapter is None or (hasattr(adapter, "dense") and hasattr(adapter, "expert")):
            return adapter
        from kimi_core.lora import load_adapter

        return load_adapter(adapter, self.config)

    # ------------------------------------------------------------------ core
    def _layers(self, h: torch.Tensor, caches: list[dict], adapter: AdapterLookup, hidden: list | None):
        """Run all layers on ``h [B, T, H]`` (embeddings) with ``caches``; returns (final stream, bank)."""
        cfg, w = self.config, self.weights
        eps = cfg.rms_norm_eps
        if cfg.attn_res_block_size:
            rb = ResidualBank(h, cfg.attn_res_block_size, eps)
            for i in range(cfg.num_hidden_layers):
                lp = cfg.layer_prefix(i)
                x = rb.attn_input(
                    i,
                    w.weight(f"{lp}self_attention_res_norm"),
                    w.weight(f"{lp}self_attention_res_proj"),
                    w.weight(f"{lp}input_layernorm"),
                )
                rb.add_attn(i, self.attn[i](x, caches[i], adapter))
                x = rb.mlp_input(
                    w.weight(f"{lp}mlp_res_norm"),
                    w.weight(f"{lp}mlp_res_proj"),
                    w.weight(f"{lp}post_attention_layernorm"),
                )
                rb.add_mlp(self.mlp[i](x, adapter))
                if hidden is not None:
                    hidden.append(rb.prefix)
            lm = cfg.lm_prefix
            out = rb.output(w.weight(f"{lm}model.output_attn_res_norm"), w.weight(f"{lm}model.output_attn_res_proj"))
            return out, rb.bank
        for i in range(cfg.num_hidden_layers):
            lp = cfg.layer_prefix(i)
            h = h + self.attn[i](rms_norm(h, w.weight(f"{lp}input_layernorm"), eps), caches[i], adapter)
            h = h + self.mlp[i](rms_norm(h, w.weight(f"{lp}post_attention_layernorm"), eps), adapter)
            if hidden is not None:
                hidden.append(h)
        return h, []

    def _run(self, input_ids: torch.Tensor, caches: list[dict], adapter: AdapterLookup, hidden: list | None):
        ids = input_ids.to(self.device)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
        w = self.weights
        h = F.embedding(ids, w.weight(self.embed_name))
        if hidden is not None:
            hidden.append(h)
        h, bank = self._layers(h, caches, adapter, hidden)
        h = rms_norm(h, w.weight(self.norm_name), self.config.rms_norm_eps)
        head = (
            self.head_name
            if w.has(f"{self.head_name}.weight") or not self.config.tie_word_embeddings
            else self.embed_name
        )
        return w.linear(h, head, adapter), bank

    # ------------------------------------------------------------------ public API
    def forward(
        self,
        input_ids: torch.Tensor,
        adapter: AdapterLookup | None = None,
        return_hidden: bool = False,
        routed_experts: torch.Tensor | None = None,
    ):
        """Logits ``[B, T, vocab]`` (model dtype) of ``input_ids [B, T]``.

        Weights never require grad, so no graph is built unless adapter factors do: then the
        logits are differentiable in them (the oracle of trainer-side LoRA gradients).

        :param adapter: see :meth:`resolve_adapter`.
        :param return_hidden: also return ``hidden``, a list of L+1 tensors ``[B, T, H]``:
            ``hidden[0]`` the embeddings, ``hidden[i+1]`` the residual stream after layer i (for K3
            the attention-residual ``prefix``; before the output aggregator and the final norm).
        :param routed_experts: rollout routing replay (R3): int ``[B, T, num_hidden_layers, k]``,
            the experts each token used in each layer (global layer ids, dense layers ignored), as
            rollout engines return them; every MoE layer then uses those experts with gate weights
            from its own router (:func:`kimi_core.reference.moe.replay_route`).
        """
        hidden = [] if return_hidden else None
        caches = [{} for _ in range(self.config.num_hidden_layers)]
        moes = [(i, m) for i, m in enumerate(self.mlp) if isinstance(m, MoE)]
        if routed_experts is not None:
            want = (*input_ids.shape, self.config.num_hidden_layers, self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != want:
                raise ValueError(
                    f"routed_experts has shape {tuple(routed_experts.shape)}, expected {want} "
                    "(batch, tokens, num_hidden_layers, num_experts_per_tok)"
                )
            for i, m in moes:
                m.replay = routed_experts[:, :, i].reshape(-1, want[-1])
        try:
            logits, _ = self._run(input_ids, caches, self.resolve_adapter(adapter), hidden)
        finally:
            for _, m in moes:
                m.replay = None
        self._last_shape = tuple(input_ids.shape)
        return (logits, hidden) if return_hidden else logits

    def last_routed_experts(self) -> torch.Tensor:
        """The experts of the last :meth:`forward`, int64 ``[B, T, num_hidden_layers, k]`` (dense
        layers 0): the ``routed_experts`` a rollout engine would report for replay."""
        if getattr(self, "_last_shape", None) is None:
            raise RuntimeError("last_routed_experts: call the model (forward) first")
        B, T = self._last_shape
        out = torch.zeros(B, T, self.config.num_hidden_layers, self.config.num_experts_per_tok, dtype=torch.long)
        for i, m in enumerate(self.mlp):
            if isinstance(m, MoE):
                out[:, :, i] = m.last_routing[1].reshape(B, T, -1).cpu()
        return out

    __call__ = forward

    def logprobs(
        self,
        input_ids: torch.Tensor,
        target_ids: torch.Tensor,
        adapter: AdapterLookup | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``log p(target_ids[b, t] | input_ids[b, :t+1])`` ``[B, T]`` in fp32 (fp64 for an fp64 model).

        ``target_ids`` are usually ``input_ids`` shifted by one; ``routed_experts``: as in :meth:`forward`.
        """
        logits = self.forward(input_ids, adapter, routed_experts=routed_experts)
        logits = logits.to(acc_dtype(logits.dtype))
        return torch.log_softmax(logits, -1).gather(-1, target_ids.to(logits.device).unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, adapter: AdapterLookup | None = None) -> DecodeState:
        """Process a prompt ``[B, T]`` and return the state for :meth:`step` (``state.logits`` = last position)."""
        ad = self.resolve_adapter(adapter)
        state = DecodeState(caches=[{} for _ in range(self.config.num_hidden_layers)], adapter=ad)
        return self._extend(state, input_ids)

    @torch.no_grad()
    def step(self, state: DecodeState, token: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        """Feed one token per row (``[B]`` or ``[B, 1]``); returns ``(logits [B, vocab], state)``."""
        token = token.reshape(-1, 1)
        state = self._extend(state, token)
        return state.logits, state

    def _extend(self, state: DecodeState, ids: torch.Tensor) -> DecodeState:
        logits, bank = self._run(ids, state.caches, state.adapter, None)
        state.pos += ids.shape[1]
        state.logits = logits[:, -1]
        state.bank = bank
        return state


def load_reference_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw
) -> KimiReferenceModel:
    """Open a Kimi checkpoint directory (``kimi-rl make-tiny`` output or a real release) as the oracle.

    Example::

        model = load_reference_model("/tmp/tiny-k3")
        logits = model(torch.tensor([[1, 5, 9]]))          # [1, 3, vocab]
        lp = model.logprobs(ids[:, :-1], ids[:, 1:])        # [B, T-1]
    """
    from kimi_core.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    return KimiReferenceModel(reader.config, reader, dtype=dtype, device=device, **kw)
