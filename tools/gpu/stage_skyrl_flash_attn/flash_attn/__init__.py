"""Stand-in for the ``flash_attn`` package on the GPU test machine: only ``flash_attn.bert_padding``.

SkyRL's ``skyrl/backends/skyrl_train/workers/model_wrapper.py`` imports ``pad_input`` and ``unpad_input``
from ``flash_attn.bert_padding`` at module level; flash-attn has no wheel for torch 2.11 on PyPI and its
CUDA build takes hours. ``bert_padding`` here implements those helpers from their definitions in plain
torch. Nothing else of flash-attn exists: ``from flash_attn import flash_attn_func`` raises ImportError,
and no ``flash-attn`` distribution metadata is installed, so TransformerEngine, Megatron and transformers
all see FlashAttention 2 as absent.
"""
