"""pluggy hook specifications of kimi-rl-plugins (project ``kimi_rl``, entry-point group ``kimi_rl.plugins``).

A plugin is any object (module or class instance) whose methods carry :data:`hookimpl` and have the
names below. It is found through an installed entry point::

    [project.entry-points."kimi_rl.plugins"]
    my_plugin = "my_package.kimi_plugin"          # a module, or "pkg.mod:obj"

or registered by hand with ``get_plugin_manager().register(obj)``. Hooks return **data** (lazy
``"module:attr"`` strings, dicts), never import a host themselves: the host adapter that asks
(``kimi_rl_glue.miles``, ``kimi_rl_glue.skyrl``, the vLLM/SGLang plugins) imports what it uses, in the
process that needs it. Every hook takes ``host``, one of :data:`HOSTS`, so one plugin can serve several.

Aggregation (see ``kimi_rl_glue.plugins``): list-returning hooks are concatenated and dict-returning
hooks merged, and two plugins that claim the same name raise an error naming both; ``firstresult``
hooks stop at the first non-None answer (plugins registered later are asked first, pluggy's order).
"""

from __future__ import annotations

from typing import Any

import pluggy

__all__ = ["PROJECT", "ENTRY_POINT_GROUP", "HOSTS", "hookspec", "hookimpl", "KimiRLSpec"]

PROJECT = "kimi_rl"
ENTRY_POINT_GROUP = "kimi_rl.plugins"
HOSTS = ("vllm", "sglang", "megatron", "miles", "skyrl", "demo")

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class KimiRLSpec:
    """The hooks. Signatures are the contract; implementations may omit trailing arguments."""

    # -- model registration ---------------------------------------------------------------------
    @hookspec
    def kimi_rl_models(self, host: str) -> dict[str, str] | None:
        """Model classes this plugin provides to ``host``.

        :returns: ``{HF architecture name: "module:Class"}`` (e.g.
            ``{"KimiK25ForConditionalGeneration": "kimi_vllm_plugin.models.k25:KimiK25ForCausalLM"}``);
            the host adapter registers the lazy strings (vLLM ``ModelRegistry.register_model``,
            SGLang's registry, a Megatron-Bridge bridge module to import).
        """

    # -- adapter export / import ----------------------------------------------------------------
    @hookspec(firstresult=True)
    def kimi_rl_export_adapter(self, host: str, model: Any, lora_spec: Any) -> Any:
        """Export the trainable LoRA adapter of a host ``model`` under HF/PEFT names.

        :param lora_spec: a ``kimi_core.lora`` spec (rank, alpha, targets, expert layout).
        :returns: an iterable of ``(hf_name, tensor)``, or None when this plugin does not own ``model``.
        """

    @hookspec(firstresult=True)
    def kimi_rl_import_adapter(self, host: str, model: Any, named_tensors: Any, lora_spec: Any) -> bool | None:
        """Load HF/PEFT-named adapter tensors into a host ``model``.

        :param named_tensors: iterable of ``(hf_name, tensor)``.
        :returns: True when loaded, None when this plugin does not own ``model``.
        """

    # -- sync transport -------------------------------------------------------------------------
    @hookspec
    def kimi_rl_sync_transports(self, host: str) -> dict[str, str] | None:
        """Adapter-sync transports offered for ``host``.

        :returns: ``{transport name: "module:Class"}`` (e.g. ``{"disk": ..., "cuda_ipc": ..., "shm": ...}``).
            The class is built by the sync driver with keyword arguments of its own documentation.
        """

    # -- loss registration ----------------------------------------------------------------------
    @hookspec
    def kimi_rl_losses(self, host: str) -> dict[str, str] | None:
        """Losses this plugin provides for ``host``.

        :returns: ``{loss name: "module:function"}``; the function has the host's loss signature
            (miles ``(args, batch, logits, sum_of_sample_mean)``; SkyRL ``(log_probs, old_log_probs,
            advantages, config, loss_mask, rollout_logprobs)``; ``demo``/``plain``: ours).
        """
