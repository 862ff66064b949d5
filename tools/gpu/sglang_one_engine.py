"""One SGLang engine on the tiny K3 of the GPU tests, outside pytest, to time and diagnose it on a GPU.

``python3 tools/gpu/sglang_one_engine.py OUT_DIR [none|kimi] [timeout_s]``: writes the checkpoint,
runs ``sglang_engine_script.py`` with the harness's flags, and compares with the fp32/bf16 reference.
"""

import json
import os
import pathlib
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
sys.path.insert(0, os.path.join(TESTS, "kimi_sglang_plugin"))
sys.path.insert(0, TESTS)

from sglang_engine_harness import engine_error, run_engine, write_tiny  # noqa: E402

out = pathlib.Path(sys.argv[1])
plugins = sys.argv[2] if len(sys.argv) > 2 else "none"
timeout = int(sys.argv[3]) if len(sys.argv) > 3 else 400
ck, _ = write_tiny("k3", str(out / "k3"))
t0 = time.time()
try:
    res = run_engine(out, ck, plugins=plugins, timeout=timeout, tag=f"one_{plugins}")
except AssertionError as e:
    print(f"engine failed after {time.time() - t0:.0f} s: {str(e)[-3000:]}")
    sys.exit(1)
errs = engine_error(ck, res["lps"])
print(
    json.dumps(
        {
            "start_s": res["start_s"],
            "generate_s": res["generate_s"],
            "engine_vs_fp32_rel": errs["err"],
            "bf16_ref_vs_fp32_rel": errs["floor"],
            "engine_max_abs": errs["max_abs"],
            "bf16_max_abs": errs["floor_max_abs"],
        }
    )
)
