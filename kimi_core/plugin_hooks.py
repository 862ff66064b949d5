"""The pluggy hook specifications through which ``kimi_rl_glue`` finds what each installed plugin provides.

Project ``kimi_rl``, entry-point group ``kimi_rl.plugins``. The specs live here, in the framework-free core,
so a plugin implements them without importing the glue (dependency rule: ``kimi_core`` <- each plugin <- the
glue). A plugin is a module (or object) whose functions carry :data:`hookimpl` and the names below, published
in its ``pyproject.toml``::

    [project.entry-points."kimi_rl.plugins"]
    kimi_vllm_plugin = "kimi_vllm_plugin.rl_hooks"

Hooks answer with **data**: lazy ``"module:attr"`` strings that nothing imports until the glue resolves them
(``kimi_rl_glue.plugins.resolve``), in the process that needs them, so asking never imports a host. Every
hook takes ``host``, one of :data:`HOSTS`, and answers ``None`` for a host it does not serve. The glue merges
the answers and refuses a name that two plugins claim differently, naming both plugins.
"""

from __future__ import annotations

import pluggy

__all__ = ["ENTRY_POINT_GROUP", "HOSTS", "PROJECT", "KimiRLSpec", "hookimpl", "hookspec"]

PROJECT = "kimi_rl"
ENTRY_POINT_GROUP = "kimi_rl.plugins"
#: the hosts a hook is asked about: the engines, the trainer, the RL frameworks and ``kimi-rl demo``
HOSTS = ("vllm", "sglang", "megatron", "miles", "skyrl", "demo")

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class KimiRLSpec:
    """The hooks. Signatures are the contract."""

    @hookspec
    def kimi_rl_models(self, host: str) -> dict[str, str] | None:
        """The model classes this plugin gives ``host``.

        :returns: ``{HF architecture: "module:Class"}`` (the plugin's ``registration.MODEL_CLASSES``), or ``None``.
        """

    @hookspec
    def kimi_rl_adapter_preparation(self, host: str) -> str | None:
        """How this plugin turns a trainer's HF / PEFT adapter into the form ``host`` serves.

        :returns: ``"module:function"`` of ``prepare_adapter(adapter, config) -> Adapter`` (the engine plugin's
            ``adapters.prepare_adapter``), or ``None``.
        """

    @hookspec
    def kimi_rl_sync_transports(self, host: str) -> dict[str, str] | None:
        """The adapter-sync transports (``kimi_core.sync.AdapterTransport``) offered for ``host``.

        :returns: ``{transport name: "module:Class"}``, or ``None``.
        """

    @hookspec
    def kimi_rl_losses(self, host: str) -> dict[str, str] | None:
        """The RL losses offered for ``host``.

        :returns: ``{loss name: "module:function"}`` with the host's loss signature, or ``None``.
        """
