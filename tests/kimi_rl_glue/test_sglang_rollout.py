"""The miles-k3 recipe's CPU-checkable parts: SGLang answers read into samples (the format of
``kimi_sglang_plugin.generate_outputs``), R3 in the loop's train step (replaying the model's own routing must give
its unreplayed logits, oracle: ``kimi_core.reference``), and the CPU refusal. The loop itself runs on the
GPU (``tests/kimi_rl_glue/test_demo_gpu.py::test_miles_recipe_on_one_gpu``)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from kimi_rl_glue.demo.sglang_rollout import samples_from_outputs


def _answer(prompt, toks, lps, top, layers, k, seed):
    rng = np.random.default_rng(seed)
    routed = rng.integers(0, 16, size=(len(prompt) + len(toks) - 1, layers, k)).astype(np.int32)
    meta = {
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, toks)],
        "output_top_logprobs": [[(v, i, None) for v, i in row] for row in top],
        "routed_experts": base64.b64encode(routed.tobytes()).decode(),
    }
    return {"meta_info": meta}, routed


def test_samples_from_sglang_answers():
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    outs, want = [], []
    for g, p in enumerate(prompts):
        for j in range(2):
            toks = [20 + g, 30 + j, 40]
            top = [[(-0.1, toks[m]), (-2.5, 99)] for m in range(3)]
            o, r = _answer(p, toks, [-0.5, -1.0, -1.5], top, layers=3, k=2, seed=10 * g + j)
            outs.append(o)
            want.append((g, p, toks, r))
    samples = samples_from_outputs(outs, prompts, n=2, topk=2, routing=(3, 2))
    assert len(samples) == 4
    for s, (g, p, toks, r) in zip(samples, want):
        assert (s.group, s.prompt, s.tokens) == (g, p, toks)
        assert torch.equal(s.logprobs, torch.tensor([-0.5, -1.0, -1.5]))
        assert s.topk_ids.tolist() == [[t, 99] for t in toks] and torch.equal(
            s.topk_logprobs[0], torch.tensor([-0.1, -2.5])
        )
        assert np.array_equal(np.array(s.routed), r) and np.array(s.routed).shape == (len(p) + 2, 3, 2)


def test_sglang_answers_that_do_not_fit_are_named():
    o, _ = _answer([1, 2], [3, 4], [-1.0, -1.0], [[(-1.0, 3)], [(-1.0, 4)]], 2, 2, 0)
    with pytest.raises(ValueError, match="SGLang returned 1 answers for 1 prompts x n=2"):
        samples_from_outputs([o], [[1, 2]], n=2, topk=1, routing=None)
    del o["meta_info"]["output_top_logprobs"]
    with pytest.raises(ValueError, match="top_logprobs_num=1"):
        samples_from_outputs([o], [[1, 2]], n=1, topk=1, routing=None)
    o2, _ = _answer([1, 2], [3, 4], [-1.0, -1.0], [[(-1.0, 3)], [(-1.0, 4)]], 2, 2, 0)
    with pytest.raises(ValueError, match=r"routed_experts has .* ids, not \[>= 3, 4, 2\]"):
        samples_from_outputs([o2], [[1, 2]], n=1, topk=1, routing=(4, 2))


def test_train_step_replays_the_samples_routing(tmp_path):
    """R3 in the loop: samples carrying the reference's own routing give the same loss and gradients as
    samples without routing (the replay reproduces the model's choices), and a different routing changes them."""
    from kimi_core.checkpoint.tiny import make_tiny
    from kimi_core.lora import LoraSpec
    from kimi_rl_glue.demo.loop import LoopConfig, train_step
    from kimi_rl_glue.demo.rollout import Sample
    from kimi_rl_glue.demo.trainer import ReferenceTrainer

    ckpt = make_tiny("k2", str(tmp_path / "k2"), seed=0)
    spec = LoraSpec(rank=4, alpha=8.0, exclude_modules=("kv_b_proj",))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 200, (4, 5), generator=g)
    tokens = torch.randint(4, 200, (4, 3), generator=g)
    ids = torch.cat([prompts, tokens], 1)
    probe = ReferenceTrainer(ckpt, spec, lr=0.0)
    with torch.no_grad():
        probe.logits(ids[:, :-1])
    own = probe.model.last_routed_experts()
    other = (own + 1) % probe.config.n_routed_experts

    def run(routed):
        tr = ReferenceTrainer(ckpt, spec, lr=1e-3, seed=0)
        tr.opt.zero_grad()
        samples = [
            Sample(
                prompts[i].tolist(),
                tokens[i].tolist(),
                torch.full((3,), -5.0),
                tokens[i, :, None].clone(),
                torch.full((3, 1), -5.0),
                i // 2,
                routed=None if routed is None else routed[i].tolist(),
            )
            for i in range(4)
        ]
        rec = train_step(
            tr, samples, torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64), LoopConfig(loss="grpo_tis"), topk=1
        )
        return rec["train/loss"], rec["train/train_rollout_logprob_abs_diff"]

    plain, replayed, wrong = run(None), run(own), run(other)
    assert replayed == pytest.approx(plain, rel=1e-6, abs=1e-9)
    assert wrong[1] != pytest.approx(plain[1], rel=1e-4)


def test_miles_recipe_refuses_the_cpu(tmp_path, capsys):
    """``kimi-rl demo --recipe miles-k3`` without a GPU exits 2 with one line naming the missing CPU path."""
    from kimi_rl_glue.cli import main

    assert main(["demo", "--recipe", "miles-k3", "--out", str(tmp_path / "m")]) == 2
    captured = capsys.readouterr()
    assert "no CPU path; run it with --device cuda" in captured.out + captured.err
