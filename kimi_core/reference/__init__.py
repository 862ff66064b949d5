"""The numerical oracle: pure-PyTorch Kimi K2.x / K3 / K3.1 with HF weight names.

``load_reference_model(path)`` is the entry point; the modules hold one concept each:
``ops`` (norms, GLUs, the LoRA-aware linear), ``kda``, ``mla``, ``indexer``, ``attn_res``,
``moe``, ``weights`` (weight sources) and ``model``. Equations: ``docs/models.md``.
"""

from kimi_core.reference.model import DecodeState, KimiReferenceModel, load_reference_model
from kimi_core.reference.weights import StateDictSource, Weights

__all__ = ["DecodeState", "KimiReferenceModel", "StateDictSource", "Weights", "load_reference_model"]
