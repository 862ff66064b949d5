"""Attention Residuals of Kimi K3: the depth aggregator and the snapshot-bank schedule.

Source: ``docs/models.md`` (radixark/miles ``attn_res_aggregate`` and
``KimiK3TransformerLayer``; the Megatron-Bridge K3 layers; paper arXiv 2603.15031). Per token,
independently of every other token (so nothing is carried across decode steps)::

    rows    = [bank_0, ..., bank_{N-1}, prefix]                       fp32
    score_i = sum_d RMSNorm(rows_i)_d * w_norm[d] * w_proj[d]          eps = rms_norm_eps
    alpha   = softmax_i(score_i)
    out     = out_norm(sum_i alpha_i rows_i)                           out_norm = the sublayer's pre-norm

Schedule of layer l (0-based) with block size B, state ``(prefix, bank)``, initially
``(embedding, [])``::

    attn_in = input_layernorm(prefix) if bank empty else Agg(self_attention_res_*, input_layernorm)
    if l % B == 0: bank.append(prefix)          # snapshot before the attention output is added
    prefix  = a if l % B == 0 else prefix + a    # a = Attn(attn_in): a new block starts
    prefix += MLP(Agg(mlp_res_*, post_attention_layernorm))
    last layer: prefix = Agg(output_attn_res_*, no out-norm); logits = lm_head(norm(prefix))

After L layers the bank holds ``ceil(L / B)`` snapshots.
"""

from __future__ import annotations

import torch

from kimi_core.reference.ops import acc_dtype, rms_norm

__all__ = ["attn_res_aggregate", "ResidualBank"]


def attn_res_aggregate(
    prefix: torch.Tensor,
    bank: list[torch.Tensor],
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    out_norm_w: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depth-softmax mix of ``bank + [prefix]``, then the optional RMSNorm ``out_norm_w``.

    :param prefix: ``[..., H]`` current partial block sum; ``bank``: N tensors ``[..., H]``.
    :param norm_w: ``[H]`` (``*_res_norm.weight``); ``proj_w``: ``[1, H]`` or ``[H]`` (``*_res_proj.weight``).
    :returns: ``[..., H]`` in ``prefix.dtype``.
    """
    a = acc_dtype(prefix.dtype)
    rows = torch.stack([r.to(a) for r in [*bank, prefix]], dim=0)  # [N+1, ..., H]
    keys = rms_norm(rows, norm_w.to(a), eps)
    score = (keys * proj_w.reshape(-1).to(a)).sum(-1)  # [N+1, ...]
    alpha = score.softmax(dim=0)
    mixed = (alpha.unsqueeze(-1) * rows).sum(0).to(prefix.dtype)
    return mixed if out_norm_w is None else rms_norm(mixed, out_norm_w, eps)


class ResidualBank:
    """The ``(prefix, bank)`` state of one forward and the schedule of the module docstring.

    :param embeddings: ``[B, T, H]`` token embeddings; ``block_size``: ``attn_res_block_size``.
    """

    def __init__(self, embeddings: torch.Tensor, block_size: int, eps: float):
        self.prefix = embeddings
        self.bank: list[torch.Tensor] = []
        self.block = block_size
        self.eps = eps

    def attn_input(
        self, layer: int, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor, pre_norm_w: torch.Tensor
    ) -> torch.Tensor:
        if self.bank:
            x = attn_res_aggregate(self.prefix, self.bank, res_norm_w, res_proj_w, self.eps, pre_norm_w)
        else:
            x = rms_norm(self.prefix, pre_norm_w, self.eps)
        if layer % self.block == 0:
            self.bank.append(self.prefix)
        return x

    def add_attn(self, layer: int, a: torch.Tensor) -> None:
        self.prefix = a if layer % self.block == 0 else self.prefix + a

    def mlp_input(self, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor, pre_norm_w: torch.Tensor) -> torch.Tensor:
        return attn_res_aggregate(self.prefix, self.bank, res_norm_w, res_proj_w, self.eps, pre_norm_w)

    def add_mlp(self, m: torch.Tensor) -> None:
        self.prefix = self.prefix + m

    def output(self, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor) -> torch.Tensor:
        return attn_res_aggregate(self.prefix, self.bank, res_norm_w, res_proj_w, self.eps, None)
