"""Patch ``k25_text_model``: build K2.5's text model as our LoRA-capable K2.x class (ledger in ``__init__``)."""

from __future__ import annotations

import contextlib

__all__ = ["text_model_arch"]


@contextlib.contextmanager
def text_model_arch(module, upstream_arch: str, our_arch: str):
    """Within the block, ``module.init_vllm_registered_model(..., architectures=[upstream_arch])``
    builds ``our_arch`` instead; restored on exit."""
    orig = getattr(module, "init_vllm_registered_model", None)
    if orig is None:
        raise RuntimeError(f"kimi_vllm_plugin: {module.__name__}.init_vllm_registered_model is missing; "
                           "the K2.5 text-model patch (kimi_vllm_plugin/patches/text_model.py) needs updating")

    def build(*args, architectures=None, **kw):
        if architectures == [upstream_arch]:
            architectures = [our_arch]
        return orig(*args, architectures=architectures, **kw)

    module.init_vllm_registered_model = build
    try:
        yield
    finally:
        module.init_vllm_registered_model = orig
