"""What an SGLang ``Engine.generate`` answer holds, read into plain lists and tensors (0.5.17 and 0.5.23).

``meta_info`` of one request (``managers/tokenizer_manager.py``; ``skip_tokenizer_init=True`` leaves the text
``None``):

* ``input_token_logprobs``: ``[(logprob, token id, text)]`` per prompt token, logprob ``None`` for the first
  (``return_logprob=True, logprob_start_len=0``);
* ``output_token_logprobs``: the same per generated token (``return_logprob=True``);
* ``output_top_logprobs``: per generated token, ``[(logprob, token id, text)] * top_logprobs_num`` or ``None``
  (``top_logprobs_num=K``);
* ``routed_experts``: base64 of int32 ``[seqlen - 1, num_hidden_layers, k]``, the experts every token was routed
  to (``state_capturer/routed_experts.py``; ``enable_return_routed_experts`` on the engine and
  ``return_routed_experts=True`` on the request; dense layers hold no choice). ``seqlen`` is prompt plus
  generated tokens: the last generated token never went through the model.

Every reader raises ``ValueError`` naming the field and what does not match.
"""

from __future__ import annotations

__all__ = ["prompt_logprobs", "routed_experts", "output_logprobs"]


def prompt_logprobs(meta_info: dict, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t = 1..T-1 from ``meta_info["input_token_logprobs"]``."""
    rows = meta_info.get("input_token_logprobs")
    if rows is None:
        raise ValueError(
            "meta_info has no input_token_logprobs: generate(..., return_logprob=True, logprob_start_len=0)"
        )
    if len(rows) != len(ids):
        raise ValueError(
            f"input_token_logprobs has {len(rows)} rows for a {len(ids)}-token prompt (logprob_start_len must be 0)"
        )
    got_ids = [int(r[1]) for r in rows]
    if got_ids != list(ids):
        raise ValueError(f"input_token_logprobs token ids {got_ids} are not the prompt {list(ids)}")
    if rows[0][0] is not None:
        raise ValueError(f"first prompt token has logprob {rows[0][0]}, expected None")
    return [float(r[0]) for r in rows[1:]]


def routed_experts(meta_info: dict, T: int, layers: int, k: int) -> list:
    """The experts of the first ``T`` tokens, ``[T][layers][k]`` (int), from ``meta_info["routed_experts"]``."""
    import base64

    import numpy as np

    raw = meta_info.get("routed_experts")
    if raw is None:
        raise ValueError(
            "meta_info has no routed_experts: enable_return_routed_experts=True on the engine and "
            "return_routed_experts=True on the request"
        )
    arr = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    if arr.size % (layers * k) or arr.size // (layers * k) < T:
        raise ValueError(f"routed_experts has {arr.size} ids, not [>= {T}, {layers}, {k}]")
    return arr.reshape(-1, layers, k)[:T].tolist()


def output_logprobs(meta_info: dict, topk: int):
    """The generated tokens and their logprobs: ``(tokens [M] list, logprobs [M] fp32, topk_ids [M, topk] int64,
    topk_logprobs [M, topk] fp32)``, candidates in SGLang's order (highest first); missing candidates are id -1
    with logprob ``-inf``. ``topk=0`` reads no candidates (``[M, 0]``)."""
    import torch

    rows = meta_info.get("output_token_logprobs")
    if rows is None:
        raise ValueError("meta_info has no output_token_logprobs: generate(..., return_logprob=True)")
    tokens = [int(r[1]) for r in rows]
    lps = torch.tensor([float(r[0]) for r in rows], dtype=torch.float32)
    ids = torch.full((len(rows), topk), -1, dtype=torch.long)
    tlp = torch.full((len(rows), topk), float("-inf"))
    if topk:
        top = meta_info.get("output_top_logprobs")
        if top is None or len(top) != len(rows):
            raise ValueError(
                f"output_top_logprobs has {None if top is None else len(top)} rows for {len(rows)} "
                f"generated tokens: generate(..., top_logprobs_num={topk})"
            )
        for i, cands in enumerate(top):
            for j, c in enumerate((cands or [])[:topk]):
                ids[i, j], tlp[i, j] = int(c[1]), float(c[0])
    return tokens, lps, ids, tlp
