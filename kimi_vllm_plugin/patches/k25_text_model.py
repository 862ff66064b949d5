"""Patch ``k25_text_model``: K2.5's text model is our LoRA-capable K2.x class (the row is :data:`ENTRY`)."""

from __future__ import annotations

import contextlib

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "text_model_arch"]

ENTRY = PatchEntry(
    name="k25_text_model",
    target="vllm.model_executor.models.kimi_k25.init_vllm_registered_model",
    host="vllm",
    versions=">=0.26,<0.35",
    why="upstream K2.5 hard-codes architectures=['DeepseekV2ForCausalLM'] for its text model, which is not our "
    "LoRA-capable K2.x class (and re-registering DeepseekV2 would hijack real DeepSeek-V2 checkpoints)",
    how="while our K2.5 class's upstream __init__ runs, the module global is wrapped so that the text model is built "
    "as DeepseekV3ForCausalLM (our registered K2.x class); restored afterwards, also on error. Target read in vLLM "
    "0.26.0 - 0.34.0: kimi_k25 imports init_vllm_registered_model(vllm_config, *, prefix, hf_config, architectures) "
    "into its module and calls it with architectures=['DeepseekV2ForCausalLM']",
    upstream="vllm-project/vllm#43840 (K2.5 LoRA) would remove the need",
    remove_when="upstream K2.5 is LoRA-capable or takes its text architecture from the config",
    expect="type:function",
)


@contextlib.contextmanager
def text_model_arch(module, upstream_arch: str, our_arch: str):
    """Within the block, ``module.init_vllm_registered_model(..., architectures=[upstream_arch])`` builds
    ``our_arch`` instead; restored on exit."""
    orig = getattr(module, "init_vllm_registered_model", None)
    if orig is None:
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r}: {module.__name__}.init_vllm_registered_model is "
            "missing; kimi_vllm_plugin/patches/k25_text_model.py needs updating"
        )

    def build(*args, architectures=None, **kw):
        if architectures == [upstream_arch]:
            architectures = [our_arch]
        return orig(*args, architectures=architectures, **kw)

    module.init_vllm_registered_model = build
    try:
        yield
    finally:
        module.init_vllm_registered_model = orig
