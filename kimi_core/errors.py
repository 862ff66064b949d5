"""The one error-class family of the project: every error we raise on purpose derives from :class:`KimiError`.

Each concrete class also keeps the builtin base its callers already catch (``ValueError`` for bad input,
``RuntimeError`` for a host that cannot run us, ``ImportError`` for a missing dependency), so
``except KimiError`` catches ours and ``except ValueError`` keeps working. Plugins and the glue subclass
these; they never define an unrelated base.
"""

from __future__ import annotations

__all__ = ["KimiError", "PluginError", "PatchTargetError", "AdapterRejected"]


class KimiError(Exception):
    """Base of every error kimi-rl-plugins raises on purpose; the message names the file, flag or tensor."""


class PluginError(KimiError, RuntimeError):
    """A host (vLLM, SGLang, Megatron, a ``kimi_rl.plugins`` entry point) cannot run (part of) a plugin;
    the message names the release found, the releases supported and what to install."""


class PatchTargetError(PluginError):
    """A host symbol a recorded patch replaces is missing or no longer what the patch ledger recorded;
    the message names the ledger entry, the target and what differs."""


class AdapterRejected(KimiError, ValueError):
    """An engine plugin refuses a LoRA adapter before any of it reaches the engine (wrong layout, missing or
    extra tensor, rank or shape mismatch, NaN, stale version); the message names the adapter folder, the
    tensor and what was expected. The engine keeps serving the last adapter it accepted."""
