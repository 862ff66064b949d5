"""The Hugging Face architecture names of the Kimi models, spelled once for every package.

A checkpoint's ``config.json`` names its class in ``architectures[0]``; each host plugin maps these names to
its own classes. Import the constants instead of writing the strings, so a rename happens in one place.
"""

from __future__ import annotations

__all__ = [
    "K2",
    "K2_ALIAS",
    "K25",
    "K3",
    "K3_LINEAR",
    "K31",
    "FAMILIES",
    "ALL_ARCHITECTURES",
    "family_of",
]

#: Kimi K2 / K2.x text models: the DeepSeek-V3 architecture with INT4 ``pack-quantized`` routed experts.
K2 = "DeepseekV3ForCausalLM"
#: The name some K2 exports use for the same DeepSeek-V3 class.
K2_ALIAS = "KimiK2ForCausalLM"
#: Kimi K2.5 (vision-language wrapper around a K2 text model).
K25 = "KimiK25ForConditionalGeneration"
#: Kimi K3: KDA + gated MLA, attention-residual bank, latent MoE with MXFP4 experts.
K3 = "KimiK3ForConditionalGeneration"
#: The K3 text model on its own (the class hosts register for ``text_config``).
K3_LINEAR = "KimiK3LinearForCausalLM"
#: Kimi K3.1: K3 plus the DSA lightning indexer.
K31 = "KimiK31ForConditionalGeneration"

#: family short name (``kimi-rl make-tiny --model``) -> top-level architecture name.
FAMILIES: dict[str, str] = {"k2": K2, "k25": K25, "k3": K3, "k31": K31}

ALL_ARCHITECTURES: tuple[str, ...] = (K2, K2_ALIAS, K25, K3, K3_LINEAR, K31)

_FAMILY_OF = {K2: "k2", K2_ALIAS: "k2", K25: "k25", K3: "k3", K3_LINEAR: "k3", K31: "k31"}


def family_of(architecture: str) -> str | None:
    """The family short name (``"k2"``, ``"k25"``, ``"k3"``, ``"k31"``) of ``architecture``, or None if not Kimi."""
    return _FAMILY_OF.get(architecture)
