"""K3.1 DSA indexer oracle: top-k >= T is exactly K3, small top-k is brute-force masked attention."""

from __future__ import annotations

import torch
from ref_helpers import tiny
from utils import assert_close

from kimi_core.reference import KimiReferenceModel
from kimi_core.reference.ops import rms_norm


def test_topk_ge_t_equals_k3_exactly():
    """With index_topk >= T the K3.1 model gives bit-identical logits to K3 with the same (non-indexer) weights."""
    cfg31, sd31 = tiny("k31", quant="none", index_topk=64)
    cfg3, _ = tiny("k3", quant="none")
    sd3 = {k: v for k, v in sd31.items() if ".indexer." not in k}
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    a = KimiReferenceModel.from_state_dict(cfg31, sd31)(ids)
    b = KimiReferenceModel.from_state_dict(cfg3, sd3)(ids)
    assert torch.equal(a, b)
    small = KimiReferenceModel.from_state_dict(tiny("k31", quant="none", index_topk=4)[0], sd31)(ids)
    assert not torch.allclose(small, b), "a small top-k must change the logits on these inputs"


def test_small_topk_equals_brute_force_masked_attention():
    """An MLA layer with top-k 5 equals per-query attention over exactly the 5 best-scored visible keys (float64 loops)."""
    cfg, sd = tiny("k31", quant="none", index_topk=5)
    m = KimiReferenceModel.from_state_dict(cfg, sd)
    c = m.config
    layer = next(a for a in m.attn if hasattr(a, "indexer"))
    p = layer.p
    x = torch.randn(1, 13, c.hidden_size, generator=torch.Generator().manual_seed(0))  # fixed: a near-tie in the
    # fp32 top-k against the float64 loop would flip one key on some unseeded draws
    got = layer(x)

    W = lambda n: sd[f"{p}.{n}.weight"].double()
    xd = x[0].double()
    eps = c.rms_norm_eps
    qr = rms_norm(xd @ W("q_a_proj").T, W("q_a_layernorm"), eps)
    q = (qr @ W("q_b_proj").T).view(13, c.num_attention_heads, -1)
    ckv = xd @ W("kv_a_proj_with_mqa").T
    lat, kpe = rms_norm(ckv[:, : c.kv_lora_rank], W("kv_a_layernorm"), eps), ckv[:, c.kv_lora_rank :]
    kv = (lat @ W("kv_b_proj").T).view(13, c.num_attention_heads, -1)
    nh, d = c.index_n_heads, c.index_head_dim
    iq = (qr @ W("indexer.wq_b").T).view(13, nh, d)
    ik = torch.nn.functional.layer_norm(
        xd @ W("indexer.wk").T, (d,), W("indexer.k_norm"), sd[f"{p}.indexer.k_norm.bias"].double(), 1e-6
    )
    iw = (xd @ W("indexer.weights_proj").T) * nh**-0.5 * d**-0.5
    out = torch.zeros(13, c.num_attention_heads * c.v_head_dim, dtype=torch.float64)
    for t in range(13):
        score = {s: sum(iw[t, h] * torch.relu(iq[t, h] @ ik[s]) for h in range(nh)).item() for s in range(t + 1)}
        keep = sorted(score, key=lambda s: -score[s])[:5]
        for h in range(c.num_attention_heads):
            k = torch.stack([torch.cat([kv[s, h, : c.qk_nope_head_dim], kpe[s]]) for s in keep])
            v = torch.stack([kv[s, h, c.qk_nope_head_dim :] for s in keep])
            a = torch.softmax((k @ q[t, h]) * (c.qk_head_dim**-0.5), 0)
            out[t, h * c.v_head_dim : (h + 1) * c.v_head_dim] = a @ v
    out = out * torch.sigmoid(xd @ W("g_proj").T)
    ref = out @ W("o_proj").T
    assert_close("indexed MLA vs brute force", ref[None], got, 1e-5)
