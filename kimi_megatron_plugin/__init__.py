"""Kimi K2.x / K3 / K3.1 on Megatron-Core: specs, layers, W4A16 experts, native-checkpoint loading, LoRA.

Entry points:

* miles: ``--spec kimi_megatron_plugin.spec get_spec``
* without miles: :func:`kimi_megatron_plugin.models.provider.build_model` /
  :class:`kimi_megatron_plugin.models.provider.KimiModelProvider`
* checkpoints: :func:`kimi_megatron_plugin.checkpoint.load_hf_checkpoint` /
  :func:`kimi_megatron_plugin.checkpoint.export_hf_state_dict`
* Megatron-Bridge: :func:`kimi_megatron_plugin.bridge.register`
* CPU processes: :func:`kimi_megatron_plugin.cpu_parallel.initialize_cpu_parallel`

Nothing is imported at package import time, so ``import kimi_megatron_plugin`` works without
megatron-core; :mod:`kimi_megatron_plugin.models` checks the megatron-core release when it is imported
(:mod:`kimi_megatron_plugin.host_support`).
"""

__all__ = [
    "bridge",
    "checkpoint",
    "cpu_parallel",
    "host_support",
    "lora",
    "mapping",
    "models",
    "patches",
    "registration",
    "routing_replay",
    "spec",
]
