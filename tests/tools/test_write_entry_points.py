"""``tools/gpu/write_entry_points.py``: the dist-info folders it writes into a staged site make each member's entry
points visible to ``importlib.metadata`` (what vLLM and SGLang read to find plugins)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_written_site_exposes_the_engine_plugins_entry_points(tmp_path):
    """vLLM's ``vllm.general_plugins`` and SGLang's ``sglang.srt.plugins`` name ``kimi`` -> the plugins' register."""
    spec = importlib.util.spec_from_file_location(
        "write_entry_points", os.path.join(ROOT, "tools", "gpu", "write_entry_points.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(str(tmp_path), root=ROOT)
    found = {
        (ep.group, ep.name): ep.value
        for dist in importlib.metadata.distributions(path=[str(tmp_path)])
        for ep in dist.entry_points
    }
    assert found[("vllm.general_plugins", "kimi")] == "kimi_vllm_plugin:register"
    assert found[("sglang.srt.plugins", "kimi")] == "kimi_sglang_plugin:register"
    names = {dist.metadata["Name"] for dist in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert {"kimi-core", "kimi-vllm-plugin", "kimi-sglang-plugin", "kimi-megatron-plugin", "kimi-rl-glue"} <= names
