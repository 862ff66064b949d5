"""Megatron-Bridge's model provider for the Kimi architectures: our provider plus Bridge's provider contract.

:class:`KimiBridgeProvider` *is* :class:`kimi_megatron_plugin.models.provider.KimiModelProvider` (same config
translation, block spec and W4A16 / QAT / dense experts) with Bridge's ``ModelProviderMixin`` (``provide``,
``finalize``, ``provide_distributed_model``, pre-wrap hooks). Needs megatron-bridge: import it after
:func:`kimi_megatron_plugin.bridge.import_bridge`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.bridge.models.model_provider import ModelProviderMixin

from kimi_megatron_plugin.models.provider import KimiModelProvider, build_model, transformer_config

__all__ = ["KimiBridgeProvider"]


@dataclass
class KimiBridgeProvider(KimiModelProvider, ModelProviderMixin):
    """:class:`KimiModelProvider` with Bridge's provider contract.

    The megatron config is built in :meth:`finalize` (not at construction: Bridge creates the
    provider before model parallelism is initialised) from the parallel sizes set on the provider,
    the attribute names Bridge's ``initialize_model_parallel`` reads.

    :param params_dtype: fp32 (numerics checks, default) or bf16 (training).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    params_dtype: torch.dtype = torch.float32
    perform_initialization: bool = True
    # Bridge's get_model reads and sets these (its bf16 / fp16 arguments) before it sets params_dtype
    fp16: bool = False
    bf16: bool = False

    def __post_init__(self):
        pass  # deferred to finalize()

    def finalize(self) -> None:
        self.config = transformer_config(
            self.kimi,
            tensor_parallel=self.tensor_model_parallel_size,
            pipeline_parallel=self.pipeline_model_parallel_size,
            expert_parallel=self.expert_model_parallel_size,
            params_dtype=self.params_dtype,
            perform_initialization=self.perform_initialization,
        )

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        """This rank's ``GPTModel`` chunk (:func:`kimi_megatron_plugin.models.provider.build_model`).

        The config is rebuilt when ``params_dtype`` changed since :meth:`finalize`: Bridge's ``get_model`` sets
        it from its ``bf16`` / ``fp16`` arguments after the host has finalized the provider (SkyRL does).
        """
        if self.config is None or self.config.params_dtype != self.params_dtype:
            self.finalize()
        return build_model(
            self.kimi, self.config, pre_process, post_process, vp_stage, self.expert_mode, **self.expert_kwargs
        )

    __call__ = provide
