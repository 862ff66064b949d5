"""Pairwise train/rollout consistency statistics over the same token sequences.

For a pair (``a`` = the trainer side, ``b`` = the rollout side) over sampled tokens:

* ``max_abs`` / ``mean_abs`` of ``logp_a - logp_b`` (miles' ``train_rollout_logprob_abs_diff`` is the mean);
* ``kl``: miles' ``train_rollout_kl`` (the ``low_var_kl`` k3 estimate of KL(rollout || train) at the
  sampled tokens, :func:`kimi_rl_glue.losses.kl.train_rollout_kl`; 0 when the two agree);
* ``top1_agree``: fraction of positions where both pick the same next token;
* ``first_diverging_layer``: where both expose hidden states, the first layer whose relative RMS
  difference exceeds ``layer_tol`` (``None`` when none does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kimi_rl_glue.losses.kl import train_rollout_kl


@dataclass
class PairStats:
    a: str
    b: str
    max_abs: float
    mean_abs: float
    kl: float
    top1_agree: float
    first_diverging_layer: int | None
    layer_errors: list[float] | None
    flagged: bool
    median_abs: float = float("nan")  # robust to the few positions where a near-tie flips an expert
    positions: int = 0  # how many positions the statistics cover

    def as_dict(self) -> dict:
        return asdict(self)


def layer_errors(ha: list[torch.Tensor], hb: list[torch.Tensor]) -> list[float]:
    """Relative RMS difference of each layer's hidden state (float64)."""
    out = []
    for x, y in zip(ha, hb):
        x, y = x.double(), y.double()
        out.append(((x - y).pow(2).mean().sqrt() / x.pow(2).mean().sqrt().clamp_min(1e-30)).item())
    return out


def compare_pair(a: str, ra, b: str, rb, mask: torch.Tensor, tol_abs: float, layer_tol: float) -> PairStats:
    """Statistics of engine results ``ra`` vs ``rb`` over positions where ``mask`` [B, T-1] is true."""
    d = (ra.logprobs.double() - rb.logprobs.double())[mask].abs()
    kl = float(train_rollout_kl(ra.logprobs.double(), rb.logprobs.double(), mask))
    agree = (ra.top1 == rb.top1)[mask].double().mean().item()
    errs, first = None, None
    if ra.hidden is not None and rb.hidden is not None and len(ra.hidden) == len(rb.hidden):
        errs = layer_errors(ra.hidden, rb.hidden)
        first = next((i for i, e in enumerate(errs) if e > layer_tol), None)
    max_abs = d.max().item()
    return PairStats(
        a,
        b,
        max_abs,
        d.mean().item(),
        kl,
        agree,
        first,
        errs,
        flagged=max_abs > tol_abs or first is not None,
        median_abs=d.median().item(),
        positions=d.numel(),
    )


def format_table(pairs: list[PairStats], skipped: dict[str, str], mark_flagged: bool = True) -> str:
    """A fixed-width table of the pairs, then the skipped engines with their reasons.

    :param mark_flagged: end a flagged pair's row with ``<-- FLAGGED``; off where the caller judges the pairs
        against another yardstick (the demo's step 0: against the model's own bf16 error, printed under it).
    """
    w = max([28] + [len(p.a) + len(p.b) + 5 for p in pairs])
    head = (
        f"{'pair':{w}s} {'max|dlogp|':>11s} {'mean|dlogp|':>12s} {'KL(k3)':>10s} {'top1':>6s} {'first bad layer':>16s}"
    )
    lines = [head, "-" * len(head)]
    for p in pairs:
        layer = (
            "-"
            if p.first_diverging_layer is None
            else ("embeddings" if p.first_diverging_layer == 0 else f"layer {p.first_diverging_layer - 1}")
        )
        lines.append(
            f"{p.a + ' vs ' + p.b:{w}s} {p.max_abs:11.3e} {p.mean_abs:12.3e} {p.kl:10.2e} "
            f"{p.top1_agree:6.3f} {layer:>16s}{'   <-- FLAGGED' if p.flagged and mark_flagged else ''}"
        )
    for name, why in skipped.items():
        lines.append(f"{name:{w}s} skipped: {why}")
    return "\n".join(lines)
