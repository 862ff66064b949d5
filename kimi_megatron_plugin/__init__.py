"""Kimi K2.x / K3 / K3.1 on Megatron-Core: specs, layers, W4A16 experts, native-checkpoint loading.

Entry points:

* miles: ``--spec kimi_megatron_plugin.spec get_spec``
* without miles: :func:`kimi_megatron_plugin.provider.build_model` /
  :class:`kimi_megatron_plugin.provider.KimiModelProvider`
* checkpoints: :func:`kimi_megatron_plugin.checkpoint.load_hf_checkpoint` /
  :func:`kimi_megatron_plugin.checkpoint.export_hf_state_dict`

Nothing is imported at package import time, so ``import kimi_megatron_plugin`` works without
megatron-core; the submodules check the megatron-core version when they are imported.
"""

__all__ = ["checkpoint", "cpu_compat", "experts", "layers", "mapping", "pipeline", "provider", "spec", "version"]
