"""Megatron-Bridge registration of the Kimi architectures (only where megatron-bridge is importable).

megatron-bridge 0.6.2 (Python 3.12) ships only K2 (``KimiK2ForCausalLM``) and K2.5-VL; K3 is on its
``main`` branch and TransformerEngine-only, K3.1 nowhere. :func:`register` records the
architectures this plugin serves; it imports megatron.bridge lazily and raises one clear error when
it is missing. The CPU lane (Python 3.11) cannot install megatron-bridge, so this stays a guarded
registration point: the conversion itself is :mod:`kimi_megatron_plugin.checkpoint` (native HF
in, HF out), which needs no Bridge.
"""

from __future__ import annotations

ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "KimiK31ForConditionalGeneration": "kimi_k31",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "DeepseekV3ForCausalLM": "kimi_k2",  # K2.x text: architectures DeepseekV3ForCausalLM, model_type kimi_k2
}

_REGISTERED = False


class BridgeUnavailableError(ImportError):
    """megatron-bridge is not installed (it needs Python 3.12)."""


def bridge_available() -> bool:
    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        return False
    return True


def register() -> dict[str, str]:
    """Idempotent: make the Kimi architectures known to Megatron-Bridge; returns ``{architecture: model_type}``.

    Raises :class:`BridgeUnavailableError` naming what to install when megatron.bridge is absent.
    Not yet wired to ``MegatronModelBridge.register_bridge`` (needs Bridge's ``GPTModel`` provider
    contract on 0.6.2, which cannot be exercised on the CPU lane); see docs/megatron.md.
    """
    global _REGISTERED
    if not bridge_available():
        raise BridgeUnavailableError(
            "kimi_megatron_plugin.bridge: megatron-bridge is not installed; pip install "
            "'kimi-rl-plugins[bridge]' (megatron-bridge==0.6.2, Python 3.12). Without Bridge, load native "
            "checkpoints with kimi_megatron_plugin.checkpoint.load_hf_checkpoint.")
    _REGISTERED = True
    return dict(ARCHITECTURES)
