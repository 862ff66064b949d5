"""miles' ``--custom-megatron-init-path``: make the Kimi models known in every train process.

Calling convention (read in ``radixark/miles:miles/backends/megatron_utils/initialize.py``, main): at the very end of ``init(args)`` (after ``torch.distributed`` and the Megatron
parallel state are up, seeds set, tokenizer built), miles does
``load_function(args.custom_megatron_init_path)(args)``, once per train actor (every rank), before
the model is built. ``load_function`` (``miles/utils/misc.py``) splits the path at its last dot,
imports the left part and takes the attribute, so:

* ``--custom-megatron-init-path kimi_rl_glue.miles.init`` resolves to the attribute ``init`` of
  the *package* ``kimi_rl_glue.miles``, which re-exports this function (the documented spelling);
* ``kimi_rl_glue.miles.init.init`` names the same function explicitly.

What :func:`init` does, each step idempotent:

0. :func:`kimi_rl_glue.miles.topk_transport.install_train_side`: miles' train step also asks its
   ``get_batch`` for the rollout's top-K fields when the rollout data has them (score centering);
1. no GPU: :func:`kimi_megatron_plugin.patches.apply_cpu_shims` (nothing on a GPU);
2. imports :mod:`kimi_megatron_plugin.spec`, which checks the megatron-core version and fixes its
   TransformerEngine-absent flags, so a wrong install fails here with the version named;
3. :func:`kimi_megatron_plugin.bridge.register` when ``megatron.bridge`` is installed and imports on
   this megatron-core, else one log line saying why (raw mode needs no Bridge: the model comes from
   ``--spec kimi_megatron_plugin.spec get_spec``, checkpoints from :mod:`kimi_megatron_plugin.checkpoint`;
   on miles' Megatron-LM fork Megatron-Bridge 0.6 does not import);
4. imports the model modules that installed ``kimi_rl.plugins`` offer for host ``megatron``
   (hook ``kimi_rl_models``), so their bridges register on import in this process too.

miles' raw Megatron->HF converter is a hard-coded chain on ``--model-name`` and cannot be extended
from here; the adapter-only sync does not use it (``kimi_rl_glue.miles.lora_provider`` exports
the adapter under HF names).
"""

from __future__ import annotations

import logging

__all__ = ["init"]

log = logging.getLogger(__name__)

#: the module of our Bridge classes (what ``kimi_rl.plugins`` names for host ``megatron``)
_BRIDGE_PACKAGE = "kimi_megatron_plugin.bridge"


def init(args) -> dict:
    """``--custom-megatron-init-path`` hook; returns what was done (miles ignores the value).

    :returns: ``{"topk_transport": bool, "cpu_shims": bool, "bridge": {architecture: model_type} | None,
        "plugin_models": [architecture, ...]}``, plus ``"bridge_skipped"`` (the reason) where Megatron-Bridge is
        installed but does not import on this megatron-core, with ``"plugin_models_skipped"`` (the architectures
        whose model classes are our Bridge classes).
    """
    import torch

    from kimi_rl_glue.miles import topk_transport

    done: dict = {"topk_transport": topk_transport.install_train_side()}
    done.update(cpu_shims=False, bridge=None, plugin_models=[])
    from kimi_megatron_plugin import bridge, patches

    if not torch.cuda.is_available():
        done["cpu_shims"] = patches.apply_cpu_shims()
        log.info("kimi_rl_glue.miles.init: no GPU, megatron-core CPU shims applied")
    import kimi_megatron_plugin.spec  # noqa: F401  (megatron-core version check, no-TE shims)

    if bridge.bridge_available() and (why := _bridge_import_error(bridge)) is not None:
        done["bridge_skipped"] = why
        log.warning("kimi_rl_glue.miles.init: %s", why)
    elif bridge.bridge_available():
        done["bridge"] = bridge.register()
        log.info("kimi_rl_glue.miles.init: Megatron-Bridge architectures registered: %s", sorted(done["bridge"]))
    else:
        log.info(
            "kimi_rl_glue.miles.init: megatron.bridge is not installed; Bridge registration skipped "
            "(raw mode: --spec kimi_megatron_plugin.spec get_spec and kimi_megatron_plugin.checkpoint)"
        )
    from kimi_rl_glue import plugins

    for arch, target in plugins.models("megatron").items():
        if "bridge_skipped" in done and target.startswith(_BRIDGE_PACKAGE):
            done.setdefault("plugin_models_skipped", []).append(arch)  # Bridge classes: they need Megatron-Bridge
            continue
        plugins.resolve(target)  # ImportError names the target
        done["plugin_models"].append(arch)
    return done


def _bridge_import_error(bridge) -> str | None:
    """None when Megatron-Bridge imports on this megatron-core, else the one line saying why registration is
    skipped (Megatron-Bridge 0.6 imports ``megatron.core._rank_utils.safe_get_world_size``, which miles'
    Megatron-LM fork lacks)."""
    from kimi_megatron_plugin.host_support import host_release

    try:
        bridge.import_bridge()
    except ImportError as e:
        return (
            f"Megatron-Bridge {host_release('megatron-bridge')} does not import on megatron-core "
            f"{host_release('megatron-core')} ({type(e).__name__}: {e}); Bridge registration skipped: raw mode "
            "(--spec kimi_megatron_plugin.spec get_spec, the LoRA provider, kimi_megatron_plugin.checkpoint) needs none"
        )
    return None
