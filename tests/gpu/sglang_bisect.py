"""Which K3 piece makes stock SGLang 0.5.17 and ``kimi_core.reference`` disagree on the tiny K3 (GPU, H200).

``python3 tests/gpu/sglang_bisect.py OUT_DIR [variant ...]``: writes the harness's tiny K3 once per variant
(each changes one piece of the config), starts one stock engine per variant (``SGLANG_PLUGINS=none``,
several at a time on the one GPU), and prints, per variant, the engine's prompt-logprob error against the
fp32 reference next to the bf16 reference's own error. A variant whose ratio falls back to ~1 names the
piece the two implementations read differently. Measured 2026-12-02: the harness's tiny K3 at hidden 512 (4 KDA
heads, 2 MLA heads) gave rel_rms 0.14 (bf16 itself: 9.7e-4), which is what two unrelated logprob sets score
(std 0.745 around -7.5: sqrt(2) * 0.745 / 7.5); the cause, found by reading (sglang_engine_harness.ATTN_RES_BLOCK_H),
is SGLang's attention-residual kernels at hidden < 1024. ``hidden512`` is the control that should still fail.
"""
import concurrent.futures as cf
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kimi_sglang_plugin"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sglang_engine_harness import engine_error, run_engine, write_tiny  # noqa: E402

LA = {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
      "use_full_rank_gate": True, "full_attn_layers": [4, 5], "kda_layers": [1, 2, 3]}

#: name -> text_config overrides on top of the harness's tiny K3 (hidden 1024, 2 MLA heads, 2 KDA heads of 128)
VARIANTS = {
    "base": {},
    "hidden512": {"hidden_size": 512},  # the harness before 2026-12-02: attention residuals left uninitialised
    "kda4_mla2": {"linear_attn_config": {**LA, "num_heads": 4}},  # KDA heads != MLA heads (SGLang's LoRA pool reading)
    "heads4": {"num_attention_heads": 4, "num_key_value_heads": 4, "linear_attn_config": {**LA, "num_heads": 4}},
    "all_mla": {"linear_attn_config": {**LA, "full_attn_layers": [1, 2, 3, 4, 5], "kda_layers": []}},
    "all_kda": {"linear_attn_config": {**LA, "full_attn_layers": [], "kda_layers": [1, 2, 3, 4, 5]}},
    "one_res_block": {"attn_res_block_size": 64},
    "all_dense": {"first_k_dense_replace": 5},
    "no_output_gate": {"mla_use_output_gate": False},
}


def one(name: str, root: pathlib.Path, delay: float) -> dict:
    time.sleep(delay)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    try:
        ck, _ = write_tiny("k3", str(d / "ckpt"), VARIANTS[name])
        res = run_engine(d, ck, plugins="none", tag=f"bisect_{name}", timeout=300,
                         engine_kwargs={"mem_fraction_static": 0.1})
    except Exception as e:  # noqa: BLE001 - a variant the engine cannot load is an answer too
        return {"name": name, "error": str(e)[-1500:]}
    e = engine_error(ck, res["lps"])
    return {"name": name, "engine_rel": e["err"], "bf16_rel": e["floor"], "ratio": e["err"] / e["floor"],
            "engine_max_abs": e["max_abs"]}


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:>18}: ERROR {r['error'][-600:]}"
    return (f"{r['name']:>18}: engine rel_rms {r['engine_rel']:.3e}  bf16 ref {r['bf16_rel']:.3e}  "
            f"ratio {r['ratio']:7.1f}  max_abs {r['engine_max_abs']:.3f}")


def main() -> None:
    """Each variant's line is printed (and bisect.json rewritten) as soon as it is done, so a run cut
    short by its time limit still reports the variants that finished."""
    root = pathlib.Path(sys.argv[1])
    names = sys.argv[2:] or list(VARIANTS)
    rows = []
    with cf.ThreadPoolExecutor(max_workers=int(os.environ.get("BISECT_PARALLEL", "8"))) as ex:
        futures = [ex.submit(one, n, root, 2.0 * i) for i, n in enumerate(names)]
        for f in cf.as_completed(futures):
            rows.append(f.result())
            print(_line(rows[-1]), flush=True)
            (root / "bisect.json").write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
