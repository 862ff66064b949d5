"""SGLang-side HF config of Kimi K3.1 (``model_type: kimi_k31``): K3's config plus the DSA indexer.

K3.1 is K3 with a lightning indexer on every MLA layer (``kimi_core.config``; field names
``index_n_heads``, ``index_head_dim``, ``index_topk`` in ``text_config``, inferred from
DeepSeek-V3.2). SGLang (0.5.17 and 0.5.23) keys about twenty K3 behaviours on the literal architecture
``KimiK3ForConditionalGeneration`` (KDA/mamba state-pool defaults in ``arg_groups/model_hook.py``,
the radix-cache set in ``arg_groups/overrides.py``, attention-residual reductions in
``arg_groups/boundary_reduction.py``, MLA shapes in ``ModelConfig._derive_model_shapes``, the
multimodal processor, ...). Every one of them must hold for K3.1 too, so rather than hook each
gate, this config presents the architectures list as ``[KimiK3ForConditionalGeneration,
KimiK31ForConditionalGeneration]``: gates that test ``architectures[0]`` or membership see K3,
and the two places that must tell K3.1 apart (the model registry and ``is_deepseek_dsa``) are
hooked to look for the second entry (``kimi_sglang_plugin.patches.k31_dsa_gates``). The text config
carries the same list, because SGLang calls ``is_deepseek_dsa`` on ``hf_text_config`` as well.
"""

from __future__ import annotations

from sglang.srt.configs.kimi_k3 import KimiK3Config

from kimi_core.architectures import K3, K31

__all__ = ["KimiK31Config", "K31_MODEL_TYPE", "INDEXER_FIELDS", "is_k31_config"]

#: ``config.json`` ``model_type`` of K3.1
K31_MODEL_TYPE = "kimi_k31"
#: the indexer fields of K3.1's ``text_config``
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def is_k31_config(config) -> bool:
    """True for a K3.1 config (HF dict or ``PretrainedConfig``, top-level or text config):
    the architectures list names K3.1 and ``index_topk`` is set."""
    if isinstance(config, dict):
        archs, topk = config.get("architectures") or [], config.get("index_topk")
    else:
        archs, topk = getattr(config, "architectures", None) or [], getattr(config, "index_topk", None)
    return K31 in archs and topk is not None


class KimiK31Config(KimiK3Config):
    """``KimiK3Config`` + indexer fields; architectures aliased as described in the module doc.

    :raises ValueError: naming the field when a given ``text_config`` lacks an indexer field.
    """

    model_type = K31_MODEL_TYPE

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        super().__init__(text_config=text_config, vision_config=vision_config, **kwargs)
        tc = self.text_config
        # transformers builds a default instance (no text_config) to diff against: nothing to check there
        for name in INDEXER_FIELDS if text_config is not None else ():
            v = getattr(tc, name, None)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"config.json: text_config.{name}={v!r}; K3.1 ({K31}) needs a positive int")
        archs = list(self.architectures or [K31])
        if K31 in archs:
            archs = [K3, K31] + [a for a in archs if a not in (K3, K31)]
        self.architectures = archs
        tc.architectures = list(archs)

    # SGLang reloads registry configs without flattening text_config onto the top level,
    # and is_deepseek_dsa / get_dsa_index_* read the indexer fields from whichever config they get.
    @property
    def index_topk(self) -> int:
        return self.text_config.index_topk

    @property
    def index_n_heads(self) -> int:
        return self.text_config.index_n_heads

    @property
    def index_head_dim(self) -> int:
        return self.text_config.index_head_dim
