"""Patch ``k31_config``: ``model_type: kimi_k31`` parses as K3's config class (the row is :data:`ENTRY`).

A subclass, not K3's class itself: vLLM sets ``model_type`` on the class it registers, which would rename K3's.
The ``index_*`` fields of K3.1 ride along in ``text_config``.
"""

from __future__ import annotations

from kimi_core.errors import PatchTargetError
from kimi_core.patch_ledger import PatchEntry

__all__ = ["ENTRY", "MODEL_TYPE", "register_k31_config"]

MODEL_TYPE = "kimi_k31"

ENTRY = PatchEntry(
    name="k31_config",
    target="vllm.transformers_utils.config._CONFIG_REGISTRY",
    host="vllm",
    versions=">=0.26,<0.34",
    why="vLLM and transformers do not know model_type kimi_k31, and vLLM parses config.json before it looks at the "
    "model registry; K3.1's config is K3's plus index_* fields",
    how="register() adds the key kimi_k31 with a KimiK3Config subclass (register_k31_config) where K3.1 is "
    "supported; idempotent, and an existing kimi_k31 key is left alone",
    upstream="vLLM 0.34 ships its own (kimi_k31 -> KimiK3Config, K3.1's indexer in text_config.dsa_config), where "
    "our K3.1 range has ended; before 0.34 K3.1 is not in vLLM",
    remove_when="the K3.1 range starts at a vLLM with its own K3.1 config (0.34)",
)


def register_k31_config() -> None:
    """Add ``kimi_k31`` to ``vllm.transformers_utils.config._CONFIG_REGISTRY``; idempotent.

    :raises PatchTargetError: the registry is missing in the installed vLLM.
    """
    import vllm.transformers_utils.config as tc
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    reg = getattr(tc, "_CONFIG_REGISTRY", None)
    if reg is None:
        raise PatchTargetError(
            f"patch ledger entry {ENTRY.name!r}: {ENTRY.target} is missing; "
            "kimi_vllm_plugin/patches/k31_config.py needs updating"
        )
    if MODEL_TYPE in reg:
        return

    class KimiK31Config(KimiK3Config):
        """K3's config under ``model_type: kimi_k31``."""

        model_type = MODEL_TYPE

        # an explicit __init__: without one, transformers 5 builds the subclass's fields from the
        # class annotations and ``text_config`` stays a plain dict
        def __init__(self, text_config=None, **kwargs):
            super().__init__(text_config=text_config, **kwargs)

    reg[MODEL_TYPE] = KimiK31Config
